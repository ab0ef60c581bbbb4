"""What the deploy tests need to know about the Grafana dashboards.

Reads deploy/grafana/dashboards/*.json and docs/metrics.md, and answers: which
PromQL expressions the dashboards run, with their template variables filled
in, and which metric names each expression reads. Standard library only.

Used by check_deploy_files.sh (through the command line below) and imported
by dashboards_prometheus_test.py.

  python3 dashboards.py check SOURCE_DIR     metric names vs docs/metrics.md
  python3 dashboards.py rules SOURCE_DIR     every expression as a promtool
                                             rules file (on stdout)
  python3 dashboards.py explain SOURCE_DIR dashboard_query_N ...
                                             which panels those rules come from
"""

import dataclasses
import glob
import json
import os
import re
import sys

DASHBOARD_DIR = "deploy/grafana/dashboards"
METRICS_DOC = "docs/metrics.md"
DATASOURCE_PROVISIONING = "deploy/grafana/provisioning/datasources/prometheus.yml"

# What each template variable stands for when an expression is evaluated
# outside Grafana. `job` is replaced by a real job id where one exists.
DEFAULT_VARIABLES = {
    "job": "job-000001",
    "strategy": "ddp",
    "mesh": "ddp2",
    "rank": "0",
    "__rate_interval": "15s",
    "__interval": "5s",
    "__range": "5m",
}

HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
PROMQL_KEYWORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right",
    "and", "or", "unless", "bool", "offset", "inf", "nan",
}


@dataclasses.dataclass
class Query:
    """One expression a dashboard runs: a panel target or a variable query."""
    dashboard: str  # file name, e.g. job-detail.json
    where: str      # panel title and refId, or "variable NAME"
    expr: str       # as written in the dashboard (PromQL, or label_values(...))

    def __str__(self):
        return f"{self.dashboard}: {self.where}"


def load_dashboards(source_dir):
    """{file name: parsed JSON} for every dashboard; raises on invalid JSON."""
    boards = {}
    for path in sorted(glob.glob(os.path.join(source_dir, DASHBOARD_DIR, "*.json"))):
        with open(path, encoding="utf-8") as f:
            boards[os.path.basename(path)] = json.load(f)
    return boards


def _panels(panels):
    for panel in panels or []:
        yield panel
        yield from _panels(panel.get("panels"))  # rows hold their panels when collapsed


def panel_queries(name, board):
    for panel in _panels(board.get("panels")):
        for target in panel.get("targets") or []:
            if target.get("expr"):
                title = panel.get("title") or panel.get("type")
                yield Query(name, f"panel '{title}' target {target.get('refId')}",
                            target["expr"])


def variable_queries(name, board):
    for variable in board.get("templating", {}).get("list", []):
        if variable.get("type") != "query":
            continue
        query = variable.get("query")
        if isinstance(query, dict):
            query = query.get("query")
        if query:
            yield Query(name, f"variable {variable['name']}", query)


def substitute(expr, values):
    """Fills in $name, ${name}, ${name:format} and [[name]]; raises on a
    variable `values` does not name."""
    pattern = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)\]\]")

    def replace(match):
        name = match.group(1) or match.group(2) or match.group(3)
        if name not in values:
            raise KeyError(f"no value for template variable ${name} in: {expr}")
        return values[name]

    return pattern.sub(replace, expr)


_LABEL_VALUES = re.compile(r"^\s*label_values\(\s*(.*),\s*(\w+)\s*\)\s*$", re.S)


def as_promql(expr):
    """A variable's label_values(SELECTOR, LABEL) as a PromQL query that is
    non-empty exactly when the variable has values; PromQL unchanged."""
    match = _LABEL_VALUES.match(expr)
    if match:
        return f"count by ({match.group(2)}) ({match.group(1)})"
    return expr


def metric_names(expr):
    """The metric names a PromQL expression reads (a light scan, not a parser:
    it drops strings, label matchers, ranges and grouping labels, then keeps
    the identifiers that are neither functions nor keywords)."""
    text = re.sub(r'"(\\.|[^"\\])*"|\'(\\.|[^\'\\])*\'|`[^`]*`', '""', expr)
    text = re.sub(r"\{[^{}]*\}", " ", text)
    text = re.sub(r"\[[^\[\]]*\]", " ", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)",
                  " ", text)
    names = set()
    for match in re.finditer(r"(?<![\w.:$])([a-zA-Z_:][a-zA-Z0-9_:]*)(\s*\()?", text):
        name, call = match.group(1), match.group(2)
        if call or name.lower() in PROMQL_KEYWORDS:
            continue
        names.add(name)
    return names


def documented_metrics(source_dir):
    """{name: type} from the tables of docs/metrics.md."""
    row = re.compile(r"^\|\s*`(shardtrain_[a-z0-9_]+)`\s*\|\s*(\w+)\s*\|")
    metrics = {}
    with open(os.path.join(source_dir, METRICS_DOC), encoding="utf-8") as f:
        for line in f:
            match = row.match(line)
            if match:
                metrics[match.group(1)] = match.group(2)
    return metrics


def is_documented(name, documented):
    if name in documented:
        return True
    for suffix in HISTOGRAM_SUFFIXES:
        base = name[: -len(suffix)]
        if name.endswith(suffix) and documented.get(base) == "histogram":
            return True
    return False


def is_gpu_metric(name):
    return name.startswith("shardtrain_gpu_") or name.startswith("DCGM_")


def all_queries(boards):
    for name, board in boards.items():
        yield from panel_queries(name, board)
        yield from variable_queries(name, board)


# --------------------------------------------------------------------------
# Command line, for check_deploy_files.sh.

def _check(source_dir):
    """Prints one line per problem; returns how many there were."""
    problems = []
    boards = load_dashboards(source_dir)
    if not boards:
        problems.append(f"no dashboards in {DASHBOARD_DIR}")
    documented = documented_metrics(source_dir)
    if not documented:
        problems.append(f"no metric table rows found in {METRICS_DOC}")
    with open(os.path.join(source_dir, DATASOURCE_PROVISIONING), encoding="utf-8") as f:
        uids = re.findall(r"^\s*uid:\s*(\S+)", f.read(), re.M)
    used = set()
    for name, board in boards.items():
        if not board.get("uid") or not board.get("title"):
            problems.append(f"{name}: needs a uid and a title")
        ids = [p.get("id") for p in _panels(board.get("panels"))]
        if len(ids) != len(set(ids)):
            problems.append(f"{name}: panel ids are not unique")
        for panel in _panels(board.get("panels")):
            wrong = {source.get("uid") for source in [panel.get("datasource")] + [
                         t.get("datasource") for t in panel.get("targets") or []]
                     if isinstance(source, dict) and source.get("type") == "prometheus"
                     and source.get("uid") not in uids}
            if wrong:
                problems.append(
                    f"{name}: panel '{panel.get('title')}' uses data source uid "
                    f"{', '.join(sorted(map(str, wrong)))}; {DATASOURCE_PROVISIONING} "
                    f"provisions {', '.join(uids)}")
    for query in all_queries(boards):
        names = metric_names(as_promql(query.expr))
        if not names:
            problems.append(f"{query}: reads no metric: {query.expr}")
        for metric in sorted(names):
            used.add(metric)
            if metric.startswith("DCGM_") or is_documented(metric, documented):
                continue
            problems.append(f"{query}: metric {metric} is not in {METRICS_DOC} "
                            f"(nor a DCGM_ metric): {query.expr}")
    for problem in problems:
        print(f"  {problem}")
    unused = sorted(m for m in documented
                    if not any(u == m or u.startswith(m + "_") for u in used))
    if unused:
        print(f"  (documented but on no dashboard: {', '.join(unused)})")
    return len(problems)


def _rules(source_dir):
    """Every expression, variables filled in, as recording rules named
    dashboard_query_N (N counts all_queries())."""
    rules = []
    for i, query in enumerate(all_queries(load_dashboards(source_dir))):
        rules.append({"record": f"dashboard_query_{i}",
                      "expr": substitute(as_promql(query.expr), DEFAULT_VARIABLES)})
    json.dump({"groups": [{"name": "dashboards", "rules": rules}]}, sys.stdout, indent=1)
    print()


def _explain(source_dir, rule_names):
    """Where the rules that _rules() named come from."""
    queries = list(all_queries(load_dashboards(source_dir)))
    for rule in rule_names:
        query = queries[int(rule.rsplit("_", 1)[1])]
        print(f"      {rule} is {query}: {query.expr}")


if __name__ == "__main__":
    command = sys.argv[1] if len(sys.argv) > 2 else None
    if command == "check" and len(sys.argv) == 3:
        sys.exit(1 if _check(sys.argv[2]) else 0)
    elif command == "rules" and len(sys.argv) == 3:
        _rules(sys.argv[2])
    elif command == "explain":
        _explain(sys.argv[2], sys.argv[3:])
    else:
        sys.exit(__doc__)
