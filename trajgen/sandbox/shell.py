"""The shell snippets the container backends (docker, apptainer, modal) run in their images: one
command's call, a file's read and write, the PID 1 that reaps orphans, the kill of what is left."""

# PID 1: waits, with no child of its own, on a FIFO nobody else may open, and reaps each orphan as it dies
# (SIGCHLD breaks the wait). A child (a `sleep`) would be a process the commands' user cannot signal, and
# `kill -9 -1` counts those as success: the command loop's wait for every killed process would never end.
REAPER = ("trap : CHLD; if mkfifo -m 600 /dev/.trajgen-reaper; then while :; do wait; read _ < /dev/.trajgen-reaper; "
          "done; fi 2>/dev/null; while :; do sleep 2147483647 & wait; done")
PREFER_BASH = 'if command -v bash >/dev/null 2>&1; then exec bash -c "$1"; fi; exec sh -c "$1"'
# the call's shell runs the command, then kills every process it may signal (its uid's; all but PID 1 as root)
ONE_CALL = f'({PREFER_BASH}) </dev/null; code=$?; kill -9 -1 2>/dev/null; exit $code'
MERGED = f"exec 2>&1; {ONE_CALL}"  # stdout and stderr interleaved in one stream, as the other backends give them
KILL_ALL = ("sh", "-c", "kill -9 -1 2>/dev/null; true")  # every process the caller may signal, but itself
WRITE = 'mkdir -p "$(dirname "$1")" && cat > "$1"'
READ = '[ ! -e "$1" ] || [ -f "$1" ] || { echo "not a regular file" >&2; exit 1; }; exec cat -- "$1"'
