#!/usr/bin/env bash
# Installs everything Ferry's build and tests need on a fresh Debian machine (run as root).
# Idempotent: a second run installs nothing new.
set -euo pipefail

need_apt=()
# iproute2: `ip`, with which `ferry cluster up` makes its separate nodes' network; util-linux:
# nsenter and setsid, for the tests; chromium: the real headless browser that reads the daemon's
# page in tests/observe.rs.
for pkg in gcc make libc6-dev python3 redis-server redis-tools golang-go procps psmisc openssl \
  iproute2 util-linux chromium; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need_apt+=("$pkg")
done
# golang-go is only needed when no Go toolchain is on the PATH already.
if command -v go >/dev/null 2>&1; then
  need_apt=("${need_apt[@]/golang-go}")
fi
if [ -n "$(echo "${need_apt[@]:-}" | tr -d ' ')" ]; then
  echo "install-deps: apt-get install ${need_apt[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  # shellcheck disable=SC2068
  apt-get install -y -qq --no-install-recommends ${need_apt[@]} >/dev/null
fi

if ! command -v cargo >/dev/null 2>&1; then
  if [ -x "$HOME/.cargo/bin/cargo" ]; then
    export PATH="$HOME/.cargo/bin:$PATH"
  else
    echo "install-deps: no Rust toolchain found (cargo); install rustup first" >&2
    exit 1
  fi
fi
if command -v rustup >/dev/null 2>&1; then
  rustup component add rustfmt clippy >/dev/null 2>&1 || true
fi
