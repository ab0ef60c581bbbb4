// The backends shardtraind is built with, one row each: the only place that
// names them (server/backend.h).
#ifndef SHARDTRAIN_SERVER_BACKENDS_H_
#define SHARDTRAIN_SERVER_BACKENDS_H_

#include "server/backend.h"

namespace shardtrain {

// local (the default), slurm.
BackendRegistry BuiltinBackends();

}  // namespace shardtrain

#endif  // SHARDTRAIN_SERVER_BACKENDS_H_
