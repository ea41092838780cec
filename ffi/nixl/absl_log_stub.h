// absl_log_stub.h: stand-ins for the abseil logging macros that NIXL's headers mention
// (LOG, VLOG, DVLOG, CHECK, DCHECK), for building this plugin where abseil >= 20230125
// headers are not installed (`make ABSL_STUB=1`). The plugin never logs through NIXL; these
// only let NIXL's inline header code compile, and discard anything streamed into them.
#pragma once

namespace objectcache_nixl_stub {
struct Discard {
    template <class T>
    Discard &
    operator<<(const T &) {
        return *this;
    }
    Discard &
    WithPerror() {
        return *this;
    }
};
} // namespace objectcache_nixl_stub

#define LOG(severity) ::objectcache_nixl_stub::Discard()
#define VLOG(level) ::objectcache_nixl_stub::Discard()
#define DVLOG(level) ::objectcache_nixl_stub::Discard()
#define CHECK(condition) (void)(condition), ::objectcache_nixl_stub::Discard()
#define DCHECK(condition) ::objectcache_nixl_stub::Discard()
