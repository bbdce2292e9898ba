# Runs inside a prompt's sandbox, started once per sandbox by supervisor.py as `bash -c <this file>`.
# A request is two lines: "<timeout seconds> <marker>", then the command with every backslash
# doubled and every newline written as \n. The command runs in its own session with its output on
# ours; when it exits or times out, everything else in the sandbox's PID namespace is killed
# (kill -9 -1 reaches exactly those, setsid and double-forked children included) and /tmp is
# emptied: each command starts as it would in a fresh sandbox. Then "<marker> <exit code>" ends
# the answer.
shopt -s nullglob dotglob
while IFS= read -r header && IFS= read -r line; do
    printf -v command '%b' "$line"
    timeout --foreground -s KILL "${header%% *}" setsid -w bash -c "$command" </dev/null 2>&1
    code=$?
    for ((i = 0; i < 10000; i++)); do  # until the namespace's init has reaped every zombie
        kill -9 -1 2>/dev/null || break
    done
    left=(/tmp/*)
    if ((${#left[@]})); then rm -rf -- "${left[@]}"; fi
    printf '%s %d\n' "${header#* }" "$code"
done
