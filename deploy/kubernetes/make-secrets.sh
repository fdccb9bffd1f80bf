#!/usr/bin/env bash
# Makes the files base/kustomization.yaml's secretGenerator reads, in base/secrets/ (git ignores it). Keeps
# every file that exists, so a second run changes nothing; delete one to make it anew.
#   cluster.secret                 the control plane's secret: 32 random bytes, hex
#   api-keys.json                  the users' key store, with one key "admin" (role admin); its plaintext
#   admin.key                      goes to admin.key, which stays here (never in the cluster): hand it to
#                                  `l4m run` (L4M_API_KEY_FILE) or the gateway's callers
#   executor-tls/ca.key, ca.crt    a CA of this cluster's own (ca.key never leaves this directory)
#   executor-tls/tls.key, tls.crt  the executors' certificate, for *.executor.NAMESPACE.svc, signed by it
# Usage: deploy/kubernetes/make-secrets.sh [--namespace NS] [--dir DIR]
#   NS   the namespace the executors run in (default l4m, as base/namespace.yaml)
#   DIR  where to write (default: base/secrets beside this script)
# Needs openssl and the l4m CLI (`l4m keys`); L4M=path/to/l4m picks another than the one on PATH.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
namespace=l4m
dir=$here/base/secrets
while [ $# -gt 0 ]; do
  case "$1" in
    --namespace) namespace=${2:?--namespace needs a value}; shift 2 ;;
    --dir) dir=${2:?--dir needs a value}; shift 2 ;;
    *) echo "make-secrets.sh: unknown argument '$1' (usage: make-secrets.sh [--namespace NS] [--dir DIR])" >&2; exit 2 ;;
  esac
done
case "$namespace" in
  *[!a-z0-9-]* | "" | -* | *-) echo "make-secrets.sh: '$namespace' is not a namespace name (a DNS label)" >&2; exit 2 ;;
esac
l4m=${L4M:-l4m}
command -v openssl >/dev/null || { echo "make-secrets.sh: openssl is not installed" >&2; exit 1; }
command -v "$l4m" >/dev/null || { echo "make-secrets.sh: the l4m CLI ('$l4m') is not found; set L4M" >&2; exit 1; }
umask 077
mkdir -p "$dir/executor-tls"
made=()

if [ ! -e "$dir/cluster.secret" ]; then
  openssl rand -hex 32 > "$dir/cluster.secret"
  made+=(cluster.secret)
fi

if [ ! -e "$dir/api-keys.json" ]; then
  rm -f "$dir/admin.key"
  if ! errors=$("$l4m" keys --keys-file "$dir/api-keys.json" add admin --role admin 2>&1 >"$dir/admin.key"); then
    rm -f "$dir/admin.key" "$dir/api-keys.json"
    echo "make-secrets.sh: '$l4m keys' failed: $errors" >&2
    exit 1
  fi
  made+=(api-keys.json admin.key)
fi

tls=$dir/executor-tls
if [ ! -e "$tls/ca.crt" ]; then
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 3650 \
    -keyout "$tls/ca.key" -out "$tls/ca.crt" -subj "/CN=l4m executors CA ($namespace)" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
  rm -f "$tls/tls.crt"  # a new CA: the certificate must be signed again
  made+=(executor-tls/ca.crt)
fi
if [ ! -e "$tls/tls.crt" ]; then
  [ -e "$tls/tls.key" ] || openssl genpkey -algorithm ec -pkeyopt ec_paramgen_curve:prime256v1 -out "$tls/tls.key"
  openssl req -new -key "$tls/tls.key" -subj "/CN=executor.$namespace.svc" -out "$tls/tls.csr"
  printf '%s\n' "subjectAltName=DNS:*.executor.$namespace.svc" "basicConstraints=critical,CA:FALSE" \
    "keyUsage=critical,digitalSignature" "extendedKeyUsage=serverAuth" > "$tls/tls.ext"
  openssl x509 -req -in "$tls/tls.csr" -CA "$tls/ca.crt" -CAkey "$tls/ca.key" -CAcreateserial -days 825 \
    -extfile "$tls/tls.ext" -out "$tls/tls.crt" 2>/dev/null
  rm -f "$tls/tls.csr" "$tls/tls.ext" "$tls/ca.srl"
  made+=(executor-tls/tls.crt)
fi

if [ ${#made[@]} -gt 0 ]; then
  echo "made in $dir: ${made[*]}"
else
  echo "nothing to make: $dir has every file"
fi
