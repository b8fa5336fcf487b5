# Sourced by the bench/*.sh scripts: starts the processes a benchmark needs and
# stops every one of them when the script exits, however it exits (done,
# failed under set -e, Ctrl-C, kill). Also gives the script a scratch folder.
#
#   bench_tmp                   a scratch folder, removed at exit
#   bench_track PID             stop PID at exit (a process started with &)
#   bench_start VAR LOG CMD...  start CMD, a server that prints "listening on
#                               HOST:PORT"; wait for that line, set VAR to
#                               HOST:PORT and bench_last_pid to its pid. Exits
#                               the script if the server dies or never listens.
#   bench_stop PID              stop one now: SIGTERM, then SIGKILL after 10 s
#
# Call these from the script's own shell, never inside $(...): a subshell's
# bench_track is lost to the parent, and its servers would outlive the script.

bench_pids=()
bench_last_pid=
bench_tmp=$(mktemp -d)

bench_track() { bench_pids+=("$1"); }

bench_stop() {
  local pid=$1 i
  kill -TERM "$pid" 2>/dev/null || true
  for ((i = 0; i < 100; i++)); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  kill -KILL "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  local kept=() p
  for p in "${bench_pids[@]}"; do [[ $p == "$pid" ]] || kept+=("$p"); done
  bench_pids=("${kept[@]}")
}

bench_start() {
  local _var=$1 _log=$2 _i; shift 2
  : >"$_log"  # before the server opens it, so the first grep finds a file
  "$@" >"$_log" 2>&1 &
  bench_last_pid=$!
  bench_track "$bench_last_pid"
  for ((_i = 0; _i < 600; _i++)); do
    if grep -q "listening on" "$_log"; then
      printf -v "$_var" '%s' "$(grep -o -m1 "listening on [0-9.]*:[0-9]*" "$_log" | awk '{print $3}')"
      return 0
    fi
    kill -0 "$bench_last_pid" 2>/dev/null || break
    sleep 0.05
  done
  echo "$(basename "$0"): $1 did not start:" >&2
  cat "$_log" >&2
  exit 1
}

bench_cleanup() {
  local p
  # Signal all first, so their shutdowns overlap.
  for p in "${bench_pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for p in "${bench_pids[@]}"; do bench_stop "$p"; done
  rm -rf "$bench_tmp"
}

trap bench_cleanup EXIT
# An explicit exit on a signal, so the EXIT trap runs for Ctrl-C and kill too.
trap 'exit 130' INT
trap 'exit 143' TERM
