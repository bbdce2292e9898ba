# Runs inside a prompt's sandbox, started once per sandbox by supervisor.py as
# `bash -c <this file> supervise [ulimit options]`. A request is two lines: a marker, then the
# command with every backslash doubled and every newline written as \n. The command runs as a job
# of its own (job control: its own process group, so a `kill 0` in it ends only the command) in a
# forked shell that sets its limits and becomes `bash -c`. When it exits, everything else in the
# sandbox's PID namespace is killed (kill -9 -1 reaches exactly those, setsid and double-forked
# children included) and /tmp is emptied: each command starts as it would in a fresh sandbox.
# Then "<marker> <exit code>" ends the answer. The host enforces the timeout by killing the sandbox.
shopt -s nullglob dotglob
set -m
while IFS= read -r marker && IFS= read -r line; do
    printf -v command '%b' "$line"
    (if (($#)); then ulimit "$@" || exit 126; fi; exec bash -c "$command") </dev/null 2>&1
    code=$?
    for ((i = 0; i < 10000; i++)); do  # until the namespace's init has reaped every zombie
        kill -9 -1 2>/dev/null || break
    done
    left=(/tmp/*)
    if ((${#left[@]})); then rm -rf -- "${left[@]}"; fi
    printf '%s %d\n' "$marker" "$code"
done
