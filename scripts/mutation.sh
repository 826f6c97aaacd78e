#!/usr/bin/env bash
# Mutation testing of the core against the fast in-process tests (mutmut):
#   ./scripts/mutation.sh [MODULE_GLOB ...]
# MODULE_GLOB defaults to every module under fila/core/ plus fila/storage/committer.py;
# pass a few to bound a run, e.g. `./scripts/mutation.sh fila/core/drr.py fila/core/leases.py`.
#
# Each mutant (a small change to one function: a flipped comparison, a changed
# constant, a dropped call) must turn at least one test red; one that leaves every
# test green ("survived") marks behaviour no test pins. mutmut runs, for each mutant,
# only the tests that called the mutated function, so the run scales with the code.
#
# Which tests: tests/core/ and every tests/test_*.py that drives the core in-process
# (imports `support.core`), plus tests/test_storage_committer.py, minus the tests in those
# files that start server processes (`-m "not process"`, see tests/conftest.py):
# a mutant lives in this process only, and a server child would never see it.
# Override with MUTATION_TESTS="tests/a.py tests/b.py".
#
# The run happens in a scratch copy of the tracked files (MUTATION_DIR, default
# .mutation/), so the work tree is never touched; the copy is kept, and a second run
# with the same code reuses mutmut's cache there. Results: $MUTATION_DIR/results.txt
# (every mutant not killed) and the score line printed at the end; inspect one with
#   (cd .mutation && ../.venv/bin/mutmut show <name>)
# MUTATION_JOBS (default 2) is how many mutants run at once. MUTATION_MINUTES bounds
# one run: mutmut is stopped (SIGINT, as Ctrl-C) after that many minutes, keeping every
# verdict reached, and the next run with the same code goes on from there; a long run
# on a shared machine is a series of such chunks, e.g.
#   MUTATION_MINUTES=14 nice -n 19 ./scripts/mutation.sh fila/core/drr.py
# (each under the machine's benchmark lock, if it has one: `flock <lock file> ...`).
# A verdict stands until the function's code changes, also when tests are added since,
# and mutmut maps tests to the functions they call once, by test name, so a test that
# was changed keeps the functions it called before. After writing tests,
# MUTATION_RERUN=1 maps every test again and judges again every mutant not killed
# (survived, or no test) among the given modules.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
root=$PWD

modules=("$@")
if [[ ${#modules[@]} -eq 0 ]]; then
  modules=("fila/core/*.py" "fila/storage/committer.py")
fi
if [[ -n "${MUTATION_TESTS:-}" ]]; then
  read -r -a tests <<<"$MUTATION_TESTS"
else
  mapfile -t tests < <(
    {
      grep -l "^from support.core import" tests/test_*.py tests/core/test_*.py
      echo tests/test_storage_committer.py
    } |
      sort -u
  )
fi
work=${MUTATION_DIR:-.mutation}
jobs=${MUTATION_JOBS:-2}
bound=()
if [[ -n "${MUTATION_MINUTES:-}" ]]; then
  # --foreground: only mutmut gets the signal; it stops its own workers and discards
  # their unfinished verdicts, where a signal to every child could record one as killed.
  bound=(timeout --foreground -s INT -k 120 "${MUTATION_MINUTES}m")
fi

echo "mutating: ${modules[*]}"
echo "tests:    ${tests[*]}"

# The scratch copy: tracked files as they are in the work tree (edits included).
mkdir -p "$work"
find "$work" -mindepth 1 -maxdepth 1 ! -name mutants -exec rm -rf {} +
git ls-files -z --cached --others --exclude-standard |
  while IFS= read -r -d "" f; do [[ -e "$f" ]] && printf '%s\0' "$f"; done |
  tar --null -T - -cf - | tar -xf - -C "$work"

toml_list() {
  local out="" item
  for item in "$@"; do out+="\"$item\", "; done
  printf '[%s]' "${out%, }"
}
# A mutant can leave a test's event loop waiting forever (a future never resolved):
# --timeout ends such a test. The limit is generous because mutmut's trampolines slow
# every call of a mutated module: the DRR property test takes about a minute under
# them (a second or two without).
cat >>"$work/pyproject.toml" <<EOF

# written by scripts/mutation.sh into its scratch copy
[tool.mutmut]
source_paths = ["fila"]
only_mutate = $(toml_list "${modules[@]}")
pytest_add_cli_args_test_selection = $(toml_list "${tests[@]}" -m "not process")
pytest_add_cli_args = ["-p", "no:cacheprovider", "-q", "--timeout=150", "-o", "timeout_method=thread"]
EOF

cd "$work"
if [[ -n "${MUTATION_RERUN:-}" ]]; then
  # which test calls what is collected again, and their verdicts are cleared
  rm -f mutants/mutmut-stats.json
  "$root/.venv/bin/python" - <<'EOF'
import json
from pathlib import Path

count = 0
for meta in Path("mutants").rglob("*.meta"):
    data = json.loads(meta.read_text())
    codes = data["exit_code_by_key"]
    for key, code in codes.items():
        if code in (0, 5, 33):  # mutmut's exit codes for survived and no tests
            codes[key] = None
            count += 1
    meta.write_text(json.dumps(data))
print(f"judging again: {count} mutants not killed")
EOF
fi
status=0
"${bound[@]}" "$root/.venv/bin/mutmut" run --max-children "$jobs" || status=$?
"$root/.venv/bin/mutmut" results >results.txt || true
"$root/.venv/bin/mutmut" export-cicd-stats >/dev/null || true
"$root/.venv/bin/python" - <<'EOF'
import json
from pathlib import Path

stats = json.loads(Path("mutants/mutmut-cicd-stats.json").read_text())
killed, timeout, survived = stats["killed"], stats.get("timeout", 0), stats["survived"]
no_tests, total = stats.get("no_tests", 0), stats["total"]
judged = killed + timeout + survived + no_tests
score = 100 * (killed + timeout) / judged if judged else 0.0
print(
    f"mutation score {score:.1f}% of {judged} mutants judged: {killed} killed, "
    f"{timeout} timed out (killed), {survived} survived, {no_tests} with no test; "
    f"{total - judged} of {total} not judged (run again to go on)"
)
EOF
echo "mutants not killed: $work/results.txt"
if [[ ${#bound[@]} -gt 0 && $status -eq 124 ]]; then
  echo "stopped after $MUTATION_MINUTES minutes; run again to go on"
  status=0
fi
exit "$status"
