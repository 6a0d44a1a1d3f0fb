#!/usr/bin/env bash
# The wheel works on its own: build the sdist and the wheel (the wheel from the
# sdist, as `python -m build` does), install the wheel into a fresh virtualenv
# OUTSIDE the checkout, and run the installed `rayslice` from a directory that
# is not the checkout:
#   - rayslice topology v6e 4x4
#   - rayslice k8s raycluster|rayjob|rayservice ...  (validated against the CRDs shipped in the wheel)
#   - rayslice sim up --slice v4:2x2x2 --detach; rayslice status; rayslice sim down   (starts Ray)
#
# Usage: .ci/wheel-smoke.sh            (from anywhere; CI runs it after `make test`)
# Locally, the simulator part starts Ray: run it under the Ray lock,
#   flock /tmp/rayslice-ray.lock .ci/wheel-smoke.sh
# Environment: PYTHON (has `build`; default .venv/bin/python), BASE_PYTHON (makes the
# fresh venv; default python3.11), KEEP=1 keeps the temp dir.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
BASE_PYTHON=${BASE_PYTHON:-$(command -v python3.11 || command -v python3)}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/rayslice-wheel.XXXXXX")
VENV=$WORK/venv
export RAYSLICE_HOME=$WORK/home   # the smoke's simulator state, never the user's
unset PYTHONPATH RAYSLICE_KUBERAY_CRDS RAY_ADDRESS
SIM_STARTED=0
START=$SECONDS

step() { printf '\n== wheel-smoke [%3ds] %s\n' $((SECONDS - START)) "$*"; }
fail() { echo "wheel-smoke: FAILED: $*" >&2; exit 1; }
cleanup() {
    if [ "$SIM_STARTED" = 1 ]; then "$VENV/bin/rayslice" sim down >/dev/null 2>&1 || true; fi
    if [ "${KEEP:-0}" = 1 ]; then echo "wheel-smoke: kept $WORK"; else rm -rf "$WORK"; fi
}
trap cleanup EXIT

step "build sdist + wheel ($PYTHON -m build)"
"$PYTHON" -m build --outdir "$WORK/dist" "$ROOT" > "$WORK/build.log" 2>&1 || { tail -30 "$WORK/build.log"; fail "build"; }
if grep -iE "deprecat|SetuptoolsWarning|license" "$WORK/build.log" | grep -v "^adding\|^copying\|LICENSE\|License-" ; then
    fail "the build printed warnings (see above)"
fi
WHEEL=$(ls "$WORK"/dist/rayslice-*.whl)
SDIST=$(ls "$WORK"/dist/rayslice-*.tar.gz)
echo "built $(basename "$SDIST") and $(basename "$WHEEL")"
"$PYTHON" - "$WHEEL" <<'PY'
import sys, zipfile
names = set(zipfile.ZipFile(sys.argv[1]).namelist())
need = [f"rayslice/kuberay_crds/{n}" for n in
        ("ray.io_rayclusters.yaml", "ray.io_rayjobs.yaml", "ray.io_rayservices.yaml", "LICENSE", "README.md")]
need += ["rayslice/cli.py", "rayslice/k8s.py", "rayslice/topology.py"]
missing = [n for n in need if n not in names]
if missing:
    sys.exit(f"wheel lacks {missing}")
meta = zipfile.ZipFile(sys.argv[1]).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
if "License-Expression: Apache-2.0" not in meta:
    sys.exit("wheel METADATA has no 'License-Expression: Apache-2.0'")
print(f"wheel holds {len(names)} files, the KubeRay CRDs and their LICENSE; License-Expression: Apache-2.0")
PY

step "fresh virtualenv outside the checkout: $VENV"
"$BASE_PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
step "pip install the wheel (dependencies from the index / pip cache)"
"$VENV/bin/python" -m pip install -q "$WHEEL"
step "installed"

cd "$WORK"   # not the checkout: nothing can be imported from it
RS=$VENV/bin/rayslice
"$VENV/bin/python" - "$VENV" <<'PY'
import os, sys, rayslice
where = os.path.realpath(rayslice.__file__)
if not where.startswith(os.path.realpath(sys.argv[1]) + os.sep):
    sys.exit(f"rayslice imported from {where}, not from the fresh virtualenv")
print(f"rayslice {rayslice.__version__} from {os.path.dirname(where)}")
PY

step "rayslice topology v6e 4x4"
out=$("$RS" topology v6e 4x4)
echo "$out"
for fact in TPU-V6E v6e-16 tpu-v6e-slice ct6e-standard-4t; do
    grep -q -- "$fact" <<<"$out" || fail "topology output lacks $fact"
done

step "rayslice k8s ... (validated against the CRDs in the wheel)"
IMAGE=rayproject/ray:2.60.0-py311-cpu
"$RS" k8s raycluster --accelerator v6e --topology 4x4 --slices 2 --image "$IMAGE" > "$WORK/raycluster.yaml" 2> "$WORK/k8s.err" \
    || { cat "$WORK/k8s.err"; fail "rayslice k8s raycluster"; }
[ ! -s "$WORK/k8s.err" ] || { cat "$WORK/k8s.err"; fail "rayslice k8s printed to stderr"; }
"$RS" k8s rayjob --accelerator v4 --topology 2x2x2 --image "$IMAGE" --entrypoint "python -m job" > "$WORK/rayjob.yaml"
"$RS" k8s rayservice --accelerator v5e --topology 4x4 --image "$IMAGE" > "$WORK/rayservice.yaml"
"$VENV/bin/python" - "$WORK" <<'PY'
import sys, yaml
from rayslice import k8s
for kind in ("raycluster", "rayjob", "rayservice"):
    doc = yaml.safe_load(open(f"{sys.argv[1]}/{kind}.yaml"))
    k8s.validate(doc)  # the bundled CRDs, read with importlib.resources
    print(f"{kind}: {doc['kind']} {doc['metadata']['name']!r} valid against {k8s.find_crd_dir()}")
PY
head -12 "$WORK/raycluster.yaml"
if RAYSLICE_KUBERAY_CRDS=$WORK/no-such-dir "$RS" k8s raycluster --accelerator v6e --topology 4x4 --image "$IMAGE" \
        > /dev/null 2> "$WORK/bad.err"; then
    fail "a missing \$RAYSLICE_KUBERAY_CRDS was not an error"
fi
[ "$(wc -l < "$WORK/bad.err")" = 1 ] || { cat "$WORK/bad.err"; fail "the error is not one line"; }
echo "missing CRD dir -> $(cat "$WORK/bad.err")"

step "rayslice sim up --slice v4:2x2x2 --detach (RAYSLICE_HOME=$RAYSLICE_HOME)"
SIM_STARTED=1
"$RS" sim up --slice v4:2x2x2 --detach --timeout-s 240 || { cat "$RAYSLICE_HOME/sim.log" 2>/dev/null | tail -20; fail "sim up"; }
step "rayslice status"
out=$("$RS" status)
echo "$out"
grep -q "TPU-V4 2x2x2" <<<"$out" || fail "status does not show the v4 2x2x2 slice"
grep -q "free" <<<"$out" || fail "status does not show the slice as free"
step "rayslice sim down"
"$RS" sim down
SIM_STARTED=0

step "done: the wheel works on its own (total $((SECONDS - START)) s)"
