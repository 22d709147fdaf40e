#!/usr/bin/env bash
# Installs what only the tests need and a plain install does not: Debian's
# prometheus (promtool and a server the metrics tests start on loopback; its
# service is not used). Needs root or sudo, which is why scripts/install.sh
# (and so the quickstart) does not do it; scripts/test.sh calls this.
# Safe to re-run: skipped when promtool is already there.
set -euo pipefail
if ! command -v promtool >/dev/null 2>&1 && command -v apt-get >/dev/null; then
  echo "== installing prometheus (apt; for the metrics tests)"
  sudo_=""
  [ "$(id -u)" = 0 ] || sudo_="sudo"  # CI runs as root; a developer may not
  $sudo_ apt-get update -qq
  $sudo_ env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null
fi
