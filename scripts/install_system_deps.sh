#!/usr/bin/env bash
# Install the system packages kvstrata needs (Debian/Ubuntu names), by mode:
#   serve: the shared libraries the Mooncake wheel (mooncake-transfer-engine-non-cuda) links against
#          (libibverbs.so.1, librdmacm.so.1, libnuma.so.1: libibverbs1 librdmacm1 libnuma1) and a C++
#          compiler (g++) for the CPU kernels (kvstrata/model/csrc; without one the engine falls back to plain
#          torch and the kernels' tests would skip);
#   test (the default): also Debian's chromium, the headless browser the dashboard test drives through
#          Playwright (never `playwright install`: nothing is downloaded at test time).
# Idempotent: does nothing when everything is already there. Used by scripts/install.sh and CI.
set -euo pipefail

MODE=${1:-test}
case "$MODE" in
    serve) PACKAGES=(libibverbs1 librdmacm1 libnuma1 g++) ;;
    test) PACKAGES=(libibverbs1 librdmacm1 libnuma1 g++ chromium) ;;
    *) echo "usage: $0 [serve|test]  (default: test)" >&2; exit 2 ;;
esac
LIBS=(libibverbs.so.1 librdmacm.so.1 libnuma.so.1)
BROWSER=/usr/bin/chromium

have_all_libs() {
    command -v ldconfig >/dev/null 2>&1 || return 1
    local cache
    cache=$(ldconfig -p 2>/dev/null) || return 1
    for lib in "${LIBS[@]}"; do
        grep -q "$lib" <<<"$cache" || return 1
    done
}

have_all() {
    have_all_libs && command -v g++ >/dev/null 2>&1 && { [ "$MODE" = serve ] || [ -x "$BROWSER" ]; }
}

if have_all; then
    echo "install_system_deps ($MODE): Mooncake's libraries (${LIBS[*]}), g++$([ "$MODE" = test ] && echo " and $BROWSER") are present"
    exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_system_deps: no apt-get here; install ${PACKAGES[*]} (or their equivalents) with your package manager" >&2
    exit 1
fi

SUDO=()
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then
        SUDO=(sudo)
    else
        echo "install_system_deps: need root (or sudo) to install ${PACKAGES[*]}" >&2
        exit 1
    fi
fi

echo "install_system_deps: installing ${PACKAGES[*]}"
export DEBIAN_FRONTEND=noninteractive
"${SUDO[@]}" apt-get update -qq
"${SUDO[@]}" apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}"
have_all || { echo "install_system_deps: some of ${PACKAGES[*]} still missing after install" >&2; exit 1; }
