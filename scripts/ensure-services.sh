#!/usr/bin/env bash
# Starts or installs what the test suite talks to when it is missing: PostgreSQL on
# 127.0.0.1:5432 and Debian's Chromium for the browser tests (docs/design.md). Idempotent.
set -euo pipefail

if ! pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null; then
  echo "starting PostgreSQL"
  pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n1)" main start
  for _ in $(seq 1 30); do pg_isready -q -h 127.0.0.1 -p 5432 && break; sleep 1; done
fi
pg_isready -h 127.0.0.1 -p 5432

if [ ! -x /usr/bin/chromium ]; then
  echo "installing Debian's chromium for the browser tests"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null
fi
/usr/bin/chromium --version
