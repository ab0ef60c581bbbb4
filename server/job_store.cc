#include "server/job_store.h"

#include <sqlite3.h>

#include <array>
#include <cmath>
#include <iterator>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace shardtrain {
namespace {

// ---------------------------------------------------------------------------
// Schema. Migration i (1-based) takes the database from user_version i-1 to i.
// Never edit a migration that has shipped; append a new one and bump
// JobStore::kSchemaVersion.

constexpr const char* kMigrations[] = {
    // 1: jobs, their events and their per-rank step reports.
    R"sql(
CREATE TABLE jobs (
  id TEXT PRIMARY KEY,
  seq INTEGER UNIQUE NOT NULL,
  state INTEGER NOT NULL,        -- v1::JobState, copied from record
  priority INTEGER NOT NULL,     -- spec.priority, copied from record
  record BLOB NOT NULL,          -- serialized v1::Job
  secret TEXT NOT NULL,
  worker_pids TEXT NOT NULL,     -- comma-separated, in rank order
  worker_pgid INTEGER NOT NULL
);
CREATE TABLE job_events (
  id INTEGER PRIMARY KEY AUTOINCREMENT,
  job_id TEXT NOT NULL REFERENCES jobs(id) ON DELETE CASCADE,
  time_unix_ms INTEGER NOT NULL,
  state INTEGER NOT NULL,        -- v1::JobState
  message TEXT NOT NULL
);
CREATE INDEX job_events_by_job ON job_events(job_id, id);
CREATE TABLE job_metrics (
  job_id TEXT NOT NULL REFERENCES jobs(id) ON DELETE CASCADE,
  rank INTEGER NOT NULL,
  step INTEGER NOT NULL,
  loss REAL NOT NULL,            -- copied from record, for ad-hoc SQL
  record BLOB NOT NULL,          -- serialized v1::StepMetrics
  PRIMARY KEY (job_id, rank, step)
) WITHOUT ROWID;
CREATE INDEX job_metrics_by_step ON job_metrics(job_id, step, rank);
)sql",
};

static_assert(std::size(kMigrations) == JobStore::kSchemaVersion,
              "one migration per schema version");

// Statements prepared once at Open and reused; indexes into kStatementSql.
enum Statement {
  kBegin,
  kCommit,
  kRollback,
  kSavepoint,
  kReleaseSavepoint,
  kRollbackToSavepoint,
  kInsertJob,
  kUpdateJob,
  kInsertEvent,
  kLoadJobs,
  kMaxSeq,
  kGetEvents,
  kInsertMetrics,
  kGetMetrics,
  kCountMetrics,
  kStatementCount,
};

constexpr std::array<const char*, kStatementCount> kStatementSql = {
    "BEGIN IMMEDIATE",
    "COMMIT",
    "ROLLBACK",
    "SAVEPOINT batch",
    "RELEASE batch",
    "ROLLBACK TO batch",
    "INSERT INTO jobs (id, seq, state, priority, record, secret, worker_pids,"
    " worker_pgid) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
    "UPDATE jobs SET state = ?2, priority = ?3, record = ?4, worker_pids = ?5,"
    " worker_pgid = ?6 WHERE id = ?1",
    "INSERT INTO job_events (job_id, time_unix_ms, state, message)"
    " VALUES (?1, ?2, ?3, ?4)",
    "SELECT id, seq, record, secret, worker_pids, worker_pgid FROM jobs"
    " ORDER BY seq",
    "SELECT COALESCE(MAX(seq), 0) FROM jobs",
    "SELECT time_unix_ms, state, message FROM job_events WHERE job_id = ?1"
    " ORDER BY id",
    "INSERT OR REPLACE INTO job_metrics (job_id, rank, step, loss, record)"
    " VALUES (?1, ?2, ?3, ?4, ?5)",
    "SELECT rank, step, record FROM job_metrics"
    " WHERE job_id = ?1 AND step >= ?3 AND (?2 IS NULL OR rank = ?2)"
    " ORDER BY step, rank",
    "SELECT COUNT(*) FROM job_metrics",
};

// The connection's last error as a Status. Call before anything else touches
// the connection (a ROLLBACK would overwrite the message).
absl::Status SqliteError(sqlite3* db, absl::string_view operation) {
  const int code = sqlite3_extended_errcode(db);
  std::string message =
      absl::StrCat(operation, ": ", sqlite3_errmsg(db), " (sqlite ", code, ")");
  switch (code) {
    case SQLITE_CONSTRAINT_PRIMARYKEY:
    case SQLITE_CONSTRAINT_UNIQUE:
      return absl::AlreadyExistsError(std::move(message));
    case SQLITE_CONSTRAINT_FOREIGNKEY:  // the referenced job is not stored
      return absl::NotFoundError(std::move(message));
  }
  switch (code & 0xff) {
    case SQLITE_BUSY:
    case SQLITE_LOCKED:
      return absl::UnavailableError(std::move(message));
    case SQLITE_CORRUPT:
    case SQLITE_NOTADB:
      return absl::DataLossError(std::move(message));
    case SQLITE_FULL:
      return absl::ResourceExhaustedError(std::move(message));
    default:
      return absl::InternalError(std::move(message));
  }
}

// One use of a cached statement. Binding errors are remembered and reported by
// the next Step(). The destructor resets the statement and drops its bindings,
// so a half-read SELECT never keeps a read transaction (and the WAL) pinned.
class StatementUse {
 public:
  StatementUse(sqlite3* db, sqlite3_stmt* stmt) : db_(db), stmt_(stmt) {}
  ~StatementUse() {
    sqlite3_reset(stmt_);
    sqlite3_clear_bindings(stmt_);
  }
  StatementUse(const StatementUse&) = delete;
  StatementUse& operator=(const StatementUse&) = delete;

  void BindInt(int index, int64_t value) {
    Check(sqlite3_bind_int64(stmt_, index, value));
  }
  void BindDouble(int index, double value) {
    Check(sqlite3_bind_double(stmt_, index, value));
  }
  void BindNull(int index) { Check(sqlite3_bind_null(stmt_, index)); }
  void BindText(int index, absl::string_view value) {
    Check(sqlite3_bind_text64(stmt_, index, value.data(), value.size(),
                              SQLITE_TRANSIENT, SQLITE_UTF8));
  }
  void BindBlob(int index, absl::string_view value) {
    Check(sqlite3_bind_blob64(stmt_, index, value.data(), value.size(),
                              SQLITE_TRANSIENT));
  }

  // Advances the statement: true when a row is ready, false when it is done.
  absl::StatusOr<bool> Step(absl::string_view operation) {
    if (bind_error_ != SQLITE_OK) {
      return absl::InternalError(absl::StrCat(
          operation, ": binding a parameter: ", sqlite3_errstr(bind_error_)));
    }
    const int rc = sqlite3_step(stmt_);
    if (rc == SQLITE_ROW) return true;
    if (rc == SQLITE_DONE) return false;
    return SqliteError(db_, operation);
  }

  // Runs a statement that returns no rows.
  absl::Status Run(absl::string_view operation) {
    absl::StatusOr<bool> row = Step(operation);
    return row.ok() ? absl::OkStatus() : row.status();
  }

  int64_t ColumnInt(int column) const {
    return sqlite3_column_int64(stmt_, column);
  }
  // Text and blob views stay valid until the next Step() or destruction.
  absl::string_view ColumnText(int column) const {
    const unsigned char* text = sqlite3_column_text(stmt_, column);
    return {reinterpret_cast<const char*>(text),
            static_cast<size_t>(sqlite3_column_bytes(stmt_, column))};
  }
  absl::string_view ColumnBlob(int column) const {
    const void* blob = sqlite3_column_blob(stmt_, column);
    return {static_cast<const char*>(blob),
            static_cast<size_t>(sqlite3_column_bytes(stmt_, column))};
  }

 private:
  void Check(int rc) {
    if (bind_error_ == SQLITE_OK) bind_error_ = rc;
  }

  sqlite3* db_;
  sqlite3_stmt* stmt_;
  int bind_error_ = SQLITE_OK;
};

// Runs `sql` once, uncached, and returns the first column of its first row
// as text ("" when there is no row). For PRAGMAs at open time.
absl::StatusOr<std::string> QueryOne(sqlite3* db, const char* sql,
                                     absl::string_view operation) {
  const std::string what = absl::StrCat(operation, ": ", sql);
  sqlite3_stmt* stmt = nullptr;
  if (sqlite3_prepare_v2(db, sql, -1, &stmt, nullptr) != SQLITE_OK) {
    return SqliteError(db, what);
  }
  absl::StatusOr<std::string> result;
  {
    StatementUse use(db, stmt);
    absl::StatusOr<bool> row = use.Step(what);
    if (!row.ok()) {
      result = row.status();
    } else {
      result = *row ? std::string(use.ColumnText(0)) : std::string();
    }
  }
  sqlite3_finalize(stmt);
  return result;
}

std::string JoinPids(const std::vector<int>& pids) {
  return absl::StrJoin(pids, ",");
}

bool ParsePids(absl::string_view text, std::vector<int>* pids) {
  pids->clear();
  if (text.empty()) return true;
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    int pid = 0;
    if (!absl::SimpleAtoi(part, &pid)) return false;
    pids->push_back(pid);
  }
  return true;
}

}  // namespace

struct JobStore::Impl {
  // One AppendMetrics call waiting for (or taking part in) a group commit.
  struct MetricsBatch {
    const std::string* job_id = nullptr;
    const std::vector<v1::StepMetrics>* steps = nullptr;
    bool done = false;    // written under queue_mutex
    absl::Status status;  // written by the committer before `done`
  };

  ~Impl();

  absl::Status Configure() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex);
  absl::Status Migrate() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex);
  absl::Status Prepare() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex);

  // Runs `body` between BEGIN IMMEDIATE and COMMIT; rolls back when either
  // fails. `operation` names the caller in errors.
  template <typename Body>
  absl::Status InTransaction(absl::string_view operation, Body body)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex);
  void RollbackIfOpen() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex);

  absl::Status InsertEvent(const std::string& job_id, const v1::JobEvent& event,
                           absl::string_view operation)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex);

  // Writes every batch in one transaction and sets each batch's status. A
  // batch that fails (e.g. an unknown job) is rolled back alone; the others
  // still commit.
  void CommitMetrics(const std::vector<MetricsBatch*>& group)
      ABSL_LOCKS_EXCLUDED(mutex);
  absl::Status WriteMetrics(const MetricsBatch& batch)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex);

  StatementUse Use(Statement s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex) {
    return StatementUse(db, statements[s]);
  }

  std::string path;

  absl::Mutex mutex;
  sqlite3* db ABSL_GUARDED_BY(mutex) = nullptr;
  std::array<sqlite3_stmt*, kStatementCount> statements
      ABSL_GUARDED_BY(mutex) = {};

  // Group commit. queue_mutex and mutex are never held together.
  absl::Mutex queue_mutex;
  absl::CondVar queue_changed;
  std::vector<MetricsBatch*> queue ABSL_GUARDED_BY(queue_mutex);
  bool committing ABSL_GUARDED_BY(queue_mutex) = false;
};

JobStore::Impl::~Impl() {
  absl::MutexLock lock(&mutex);
  for (sqlite3_stmt*& stmt : statements) {
    sqlite3_finalize(stmt);  // no-op on nullptr
    stmt = nullptr;
  }
  // Every statement is finalized, so this closes the file (checkpointing the
  // WAL when this is the last connection).
  sqlite3_close(db);
  db = nullptr;
}

absl::Status JobStore::Impl::Configure() {
  // busy_timeout first: switching to WAL may wait for another connection.
  for (const char* pragma :
       {"PRAGMA busy_timeout = 5000", "PRAGMA synchronous = NORMAL",
        "PRAGMA foreign_keys = ON"}) {
    absl::StatusOr<std::string> ignored =
        QueryOne(db, pragma, absl::StrCat("opening ", path));
    if (!ignored.ok()) return ignored.status();
  }
  // The answer is the mode in force, which must be WAL for the durability
  // contract in the header (an in-memory database, for one, cannot be).
  absl::StatusOr<std::string> mode =
      QueryOne(db, "PRAGMA journal_mode = WAL", absl::StrCat("opening ", path));
  if (!mode.ok()) return mode.status();
  if (*mode != "wal") {
    return absl::FailedPreconditionError(absl::StrCat(
        "opening ", path, ": journal_mode is '", *mode, "', not 'wal'"));
  }
  return absl::OkStatus();
}

absl::Status JobStore::Impl::Migrate() {
  // The version is read inside the write transaction, so two processes
  // opening a fresh file cannot both run migration 1.
  const std::string operation = absl::StrCat("migrating ", path);
  if (sqlite3_exec(db, "BEGIN IMMEDIATE", nullptr, nullptr, nullptr) !=
      SQLITE_OK) {
    return SqliteError(db, operation);
  }
  absl::Status status;
  int version = 0;
  absl::StatusOr<std::string> text =
      QueryOne(db, "PRAGMA user_version", operation);
  if (!text.ok()) {
    status = text.status();
  } else if (!absl::SimpleAtoi(*text, &version)) {
    status = absl::DataLossError(
        absl::StrCat(operation, ": user_version is '", *text, "'"));
  } else if (version > kSchemaVersion) {
    status = absl::FailedPreconditionError(
        absl::StrCat(path, " has schema version ", version,
                     ", newer than the newest this build knows (",
                     kSchemaVersion, "); use a newer shardtraind"));
  }
  for (int next = version + 1; status.ok() && next <= kSchemaVersion; ++next) {
    const std::string sql = absl::StrCat(kMigrations[next - 1],
                                         "PRAGMA user_version = ", next, ";");
    if (sqlite3_exec(db, sql.c_str(), nullptr, nullptr, nullptr) != SQLITE_OK) {
      status = SqliteError(db, absl::StrCat(operation, " to version ", next));
    }
  }
  if (status.ok() &&
      sqlite3_exec(db, "COMMIT", nullptr, nullptr, nullptr) != SQLITE_OK) {
    status = SqliteError(db, operation);
  }
  if (!status.ok()) RollbackIfOpen();
  return status;
}

absl::Status JobStore::Impl::Prepare() {
  for (int i = 0; i < kStatementCount; ++i) {
    if (sqlite3_prepare_v3(db, kStatementSql[i], -1, SQLITE_PREPARE_PERSISTENT,
                           &statements[i], nullptr) != SQLITE_OK) {
      return SqliteError(
          db, absl::StrCat("preparing \"", kStatementSql[i], "\" on ", path));
    }
  }
  return absl::OkStatus();
}

template <typename Body>
absl::Status JobStore::Impl::InTransaction(absl::string_view operation,
                                           Body body) {
  if (absl::Status status = Use(kBegin).Run(operation); !status.ok()) {
    return status;
  }
  absl::Status status = body();
  if (status.ok()) status = Use(kCommit).Run(operation);
  if (!status.ok()) RollbackIfOpen();
  return status;
}

void JobStore::Impl::RollbackIfOpen() {
  // Some errors (e.g. SQLITE_FULL) already rolled the transaction back.
  if (sqlite3_get_autocommit(db) == 0) {
    sqlite3_exec(db, "ROLLBACK", nullptr, nullptr, nullptr);
  }
}

absl::Status JobStore::Impl::InsertEvent(const std::string& job_id,
                                         const v1::JobEvent& event,
                                         absl::string_view operation) {
  StatementUse insert = Use(kInsertEvent);
  insert.BindText(1, job_id);
  insert.BindInt(2, event.time_unix_ms());
  insert.BindInt(3, event.state());
  insert.BindText(4, event.message());
  return insert.Run(operation);
}

void JobStore::Impl::CommitMetrics(const std::vector<MetricsBatch*>& group) {
  absl::MutexLock lock(&mutex);
  absl::Status status = InTransaction(
      "AppendMetrics", [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex) {
        for (MetricsBatch* batch : group) {
          if (absl::Status s = Use(kSavepoint).Run("AppendMetrics"); !s.ok()) {
            return s;
          }
          batch->status = WriteMetrics(*batch);
          if (!batch->status.ok()) {
            if (absl::Status s = Use(kRollbackToSavepoint).Run("AppendMetrics");
                !s.ok()) {
              return s;
            }
          }
          if (absl::Status s = Use(kReleaseSavepoint).Run("AppendMetrics");
              !s.ok()) {
            return s;
          }
        }
        return absl::OkStatus();
      });
  // When the transaction as a whole failed, nothing was committed.
  if (!status.ok()) {
    for (MetricsBatch* batch : group) batch->status = status;
  }
}

absl::Status JobStore::Impl::WriteMetrics(const MetricsBatch& batch) {
  const std::string operation =
      absl::StrCat("AppendMetrics for job '", *batch.job_id, "'");
  std::string record;
  for (const v1::StepMetrics& step : *batch.steps) {
    if (!step.SerializeToString(&record)) {
      return absl::InternalError(
          absl::StrCat(operation, ": serializing step ", step.step()));
    }
    StatementUse insert = Use(kInsertMetrics);
    insert.BindText(1, *batch.job_id);
    insert.BindInt(2, step.rank());
    insert.BindInt(3, step.step());
    // The loss column is REAL NOT NULL, and SQLite stores a NaN as NULL: a
    // diverged step's non-finite loss goes in as text ("nan", "inf"); the
    // record keeps the exact value.
    if (std::isfinite(step.loss())) {
      insert.BindDouble(4, step.loss());
    } else {
      insert.BindText(4, std::isnan(step.loss()) ? "nan"
                         : step.loss() > 0       ? "inf"
                                                 : "-inf");
    }
    insert.BindBlob(5, record);
    if (absl::Status status = insert.Run(operation); !status.ok()) {
      return status;
    }
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<JobStore>> JobStore::Open(
    const std::string& path) {
  auto impl = std::make_unique<Impl>();
  impl->path = path;
  absl::MutexLock lock(&impl->mutex);
  const int rc = sqlite3_open_v2(
      path.c_str(), &impl->db,
      SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_NOMUTEX,
      nullptr);
  if (rc != SQLITE_OK) {
    // Without a handle (out of memory) there is no errmsg to report.
    if (impl->db == nullptr) {
      return absl::InternalError(
          absl::StrCat("opening ", path, ": ", sqlite3_errstr(rc)));
    }
    return SqliteError(impl->db, absl::StrCat("opening ", path));
  }
  if (absl::Status s = impl->Configure(); !s.ok()) return s;
  if (absl::Status s = impl->Migrate(); !s.ok()) return s;
  if (absl::Status s = impl->Prepare(); !s.ok()) return s;
  return std::unique_ptr<JobStore>(new JobStore(std::move(impl)));
}

JobStore::JobStore(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

JobStore::~JobStore() = default;

namespace {

// The stored job's record: its Job message, serialized (the prologue of
// every write of a job row).
absl::StatusOr<std::string> Serialize(const StoredJob& job,
                                      const std::string& operation) {
  std::string record;
  if (!job.job.SerializeToString(&record)) {
    return absl::InternalError(absl::StrCat(operation, ": serializing"));
  }
  return record;
}

}  // namespace

absl::Status JobStore::InsertJob(const StoredJob& job,
                                 const v1::JobEvent& event) {
  const std::string& id = job.job.id();
  const std::string operation = absl::StrCat("InsertJob '", id, "'");
  absl::StatusOr<std::string> record = Serialize(job, operation);
  if (!record.ok()) return record.status();
  absl::MutexLock lock(&impl_->mutex);
  return impl_->InTransaction(
      operation, [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(impl_->mutex) {
        StatementUse insert = impl_->Use(kInsertJob);
        insert.BindText(1, id);
        insert.BindInt(2, job.seq);
        insert.BindInt(3, job.job.state());
        insert.BindInt(4, job.job.spec().priority());
        insert.BindBlob(5, *record);
        insert.BindText(6, job.secret);
        insert.BindText(7, JoinPids(job.worker_pids));
        insert.BindInt(8, job.worker_pgid);
        if (absl::Status status =
                insert.Run(absl::StrCat(operation, " (seq ", job.seq, ")"));
            !status.ok()) {
          return status;
        }
        return impl_->InsertEvent(id, event, operation);
      });
}

absl::Status JobStore::UpdateJob(const StoredJob& job,
                                 const std::optional<v1::JobEvent>& event) {
  const std::string& id = job.job.id();
  const std::string operation = absl::StrCat("UpdateJob '", id, "'");
  absl::StatusOr<std::string> record = Serialize(job, operation);
  if (!record.ok()) return record.status();
  absl::MutexLock lock(&impl_->mutex);
  return impl_->InTransaction(
      operation, [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(impl_->mutex) {
        {
          StatementUse update = impl_->Use(kUpdateJob);
          update.BindText(1, id);
          update.BindInt(2, job.job.state());
          update.BindInt(3, job.job.spec().priority());
          update.BindBlob(4, *record);
          update.BindText(5, JoinPids(job.worker_pids));
          update.BindInt(6, job.worker_pgid);
          if (absl::Status status = update.Run(operation); !status.ok()) {
            return status;
          }
        }
        if (sqlite3_changes(impl_->db) == 0) {
          return absl::NotFoundError(absl::StrCat(operation, ": no such job"));
        }
        if (!event.has_value()) return absl::OkStatus();
        return impl_->InsertEvent(id, *event, operation);
      });
}

absl::StatusOr<std::vector<StoredJob>> JobStore::LoadJobs() const {
  absl::MutexLock lock(&impl_->mutex);
  StatementUse select = impl_->Use(kLoadJobs);
  std::vector<StoredJob> jobs;
  while (true) {
    absl::StatusOr<bool> row = select.Step("LoadJobs");
    if (!row.ok()) return row.status();
    if (!*row) break;
    StoredJob& job = jobs.emplace_back();
    const absl::string_view id = select.ColumnText(0);
    const absl::string_view record = select.ColumnBlob(2);
    if (!job.job.ParseFromArray(record.data(),
                                static_cast<int>(record.size()))) {
      return absl::DataLossError(
          absl::StrCat("LoadJobs: job '", id, "': unreadable record"));
    }
    job.seq = select.ColumnInt(1);
    job.secret = std::string(select.ColumnText(3));
    if (!ParsePids(select.ColumnText(4), &job.worker_pids)) {
      return absl::DataLossError(absl::StrCat("LoadJobs: job '", id,
                                              "': unreadable worker_pids '",
                                              select.ColumnText(4), "'"));
    }
    job.worker_pgid = static_cast<int>(select.ColumnInt(5));
  }
  return jobs;
}

absl::StatusOr<int64_t> JobStore::MaxSeq() const {
  absl::MutexLock lock(&impl_->mutex);
  StatementUse select = impl_->Use(kMaxSeq);
  absl::StatusOr<bool> row = select.Step("MaxSeq");
  if (!row.ok()) return row.status();
  return *row ? select.ColumnInt(0) : 0;
}

absl::StatusOr<std::vector<v1::JobEvent>> JobStore::GetEvents(
    const std::string& job_id) const {
  const std::string operation = absl::StrCat("GetEvents '", job_id, "'");
  absl::MutexLock lock(&impl_->mutex);
  StatementUse select = impl_->Use(kGetEvents);
  select.BindText(1, job_id);
  std::vector<v1::JobEvent> events;
  while (true) {
    absl::StatusOr<bool> row = select.Step(operation);
    if (!row.ok()) return row.status();
    if (!*row) break;
    v1::JobEvent& event = events.emplace_back();
    event.set_time_unix_ms(select.ColumnInt(0));
    event.set_state(static_cast<v1::JobState>(select.ColumnInt(1)));
    event.set_message(std::string(select.ColumnText(2)));
  }
  return events;
}

absl::Status JobStore::AppendMetrics(
    const std::string& job_id, const std::vector<v1::StepMetrics>& steps) {
  if (steps.empty()) return absl::OkStatus();
  Impl::MetricsBatch batch;
  batch.job_id = &job_id;
  batch.steps = &steps;
  Impl& impl = *impl_;

  // Leader/follower: a caller that finds no commit in progress commits every
  // queued batch (its own included) in one transaction; the others wait.
  // After one transaction the committer hands over rather than looping, so
  // under steady load no caller waits longer than two transactions.
  absl::MutexLock lock(&impl.queue_mutex);
  impl.queue.push_back(&batch);
  while (!batch.done && impl.committing) {
    impl.queue_changed.Wait(&impl.queue_mutex);
  }
  if (batch.done) return batch.status;

  impl.committing = true;
  std::vector<Impl::MetricsBatch*> group;
  group.swap(impl.queue);
  impl.queue_mutex.Unlock();
  impl.CommitMetrics(group);
  impl.queue_mutex.Lock();
  for (Impl::MetricsBatch* member : group) member->done = true;
  impl.committing = false;
  // Wakes the members of this group, and the next committer when batches
  // arrived meanwhile.
  impl.queue_changed.SignalAll();
  return batch.status;
}

absl::StatusOr<std::vector<v1::StepMetrics>> JobStore::GetMetrics(
    const std::string& job_id, std::optional<int> rank,
    int64_t from_step) const {
  const std::string operation = absl::StrCat("GetMetrics '", job_id, "'");
  absl::MutexLock lock(&impl_->mutex);
  StatementUse select = impl_->Use(kGetMetrics);
  select.BindText(1, job_id);
  if (rank.has_value()) {
    select.BindInt(2, *rank);
  } else {
    select.BindNull(2);
  }
  select.BindInt(3, from_step);
  std::vector<v1::StepMetrics> steps;
  while (true) {
    absl::StatusOr<bool> row = select.Step(operation);
    if (!row.ok()) return row.status();
    if (!*row) break;
    const absl::string_view record = select.ColumnBlob(2);
    if (!steps.emplace_back().ParseFromArray(record.data(),
                                             static_cast<int>(record.size()))) {
      return absl::DataLossError(
          absl::StrCat(operation, ": unreadable record for rank ",
                       select.ColumnInt(0), " step ", select.ColumnInt(1)));
    }
  }
  return steps;
}

absl::StatusOr<int64_t> JobStore::CountMetrics() const {
  absl::MutexLock lock(&impl_->mutex);
  StatementUse select = impl_->Use(kCountMetrics);
  absl::StatusOr<bool> row = select.Step("CountMetrics");
  if (!row.ok()) return row.status();
  return *row ? select.ColumnInt(0) : 0;
}

}  // namespace shardtrain
