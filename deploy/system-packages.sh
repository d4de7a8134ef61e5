#!/usr/bin/env bash
# Debian packages the tests and optional parts need: Chromium for the console's browser tests,
# libibverbs1 and librdmacm1 for the Mooncake Transfer Engine (disaggregated prefill/decode),
# systemd for `systemd-analyze verify` of the units deploy/systemd.py writes.
# Installs only what is missing; as root it runs apt-get itself, otherwise it says what to run.
set -euo pipefail

packages=(chromium libibverbs1 librdmacm1 systemd)
missing=()
for package in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" \
    || missing+=("$package")
done
[ ${#missing[@]} -eq 0 ] && exit 0

if ! command -v apt-get >/dev/null 2>&1; then
  echo "setup: not a Debian system; install these yourself: ${missing[*]}" >&2
  echo "setup: the browser tests need a Chromium at /usr/bin/chromium" >&2
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "setup: missing Debian packages: ${missing[*]}" >&2
  echo "setup: run this once as root, then run make again:" >&2
  echo "  sudo apt-get update && sudo apt-get install -y ${missing[*]}" >&2
  echo "setup: until then the browser tests fail, saying Chromium is missing" >&2
  exit 0
fi
echo "setup: apt-get install ${missing[*]}"
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
