# Sourced by scripts/setup_env.sh, setup_sglang.sh and test.sh: `pip_quiet CMD...` runs CMD (a pip install) with the
# notes pip prints on every such install here left out of its stderr, since none of them asks anything of the user:
# - "WARNING: Location 'file:///...' is ignored": find-links folders a machine's pip configuration names but lacks;
# - setuptools' "Editable installation" notice (a box of asterisks) for `pip install -e .`;
# - "sglang 0.5.23 requires X, which is not installed" (and the resolver's ERROR line above them): the GPU-only
#   dependencies setup_sglang.sh leaves out on purpose, with torch 2.13.0 (CPU) instead of the 2.14.1 it pins.
# Everything else pip says (a failed install above all) still shows, once pip has ended; the exit status is pip's.
pip_quiet() {
  local log status=0
  log=$(mktemp)
  "$@" 2>"$log" || status=$?
  grep -v -E \
    -e "^WARNING: Location '[^']*' is ignored: it is neither a file nor a directory\.$" \
    -e "BuildBackendWarning: Editable installation\.$" -e "^ *!!$" -e "^ *\*{20,}$" -e "^ *$" \
    -e "Please be careful with folders in your working directory with the same$" \
    -e "name as your package as they may take precedence during imports\.$" \
    -e "with strategy, WheelFile\(wheel_path, \"w\"\) as wheel_obj:$" \
    -e "^ERROR: pip's dependency resolver does not currently take into account all the packages that are installed" \
    -e "^sglang [0-9.]+ requires .*(which is not installed|but you have .* which is incompatible)\.$" "$log" >&2 || true
  rm -f "$log"
  return "$status"
}

# NO_COMPILE: pip's --no-compile, unless PYTHONDONTWRITEBYTECODE is set. pip byte-compiles every module it installs
# (torch, triton, transformers, sglang: most of them never imported); without it, Python compiles a module the first
# time one is imported and keeps its .pyc, and the setup scripts import what the job and the server use once, at the
# end. Both installs of a fresh clone, side by side: 81 s -> 38 s, plus ~17 s for those imports. Where Python may not
# write .pyc files (PYTHONDONTWRITEBYTECODE), every process would compile its imports again: there pip compiles them.
NO_COMPILE=()
[ -n "${PYTHONDONTWRITEBYTECODE:-}" ] || NO_COMPILE=(--no-compile)

# install_step LABEL WHAT CMD...: one install step, said on stderr (no install is silent for more than ~30 s): "LABEL:
# WHAT ..." as it starts, "LABEL: WHAT: still installing (N s)" every 30 s (INSTALL_TICK_S) while it runs, "LABEL:
# WHAT: done in N s (M s so far)" at its end; the exit status is CMD's.
INSTALL_START=$SECONDS
install_step() {
  local label=$1 what=$2 start=$SECONDS status=0 ticker
  shift 2
  echo "$label: $what ..." >&2
  # the ticker ends with its sleep (a sleep left running would hold the caller's pipes open, e.g. PY=$(...))
  ( trap 'kill "$nap" 2>/dev/null; exit 0' TERM
    while :; do sleep "${INSTALL_TICK_S:-30}" & nap=$!; wait "$nap"; echo "$label: $what: still installing ($((SECONDS - start)) s)" >&2
    done ) >/dev/null &
  ticker=$!
  "$@" || status=$?
  kill "$ticker" 2>/dev/null || true
  wait "$ticker" 2>/dev/null || true
  [ "$status" -ne 0 ] || echo "$label: $what: done in $((SECONDS - start)) s ($((SECONDS - INSTALL_START)) s so far)" >&2
  return "$status"
}
