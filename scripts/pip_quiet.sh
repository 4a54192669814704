# Sourced by scripts/setup_env.sh and scripts/setup_sglang.sh: `pip_quiet CMD...` runs CMD (a pip install) with the
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
