#!/usr/bin/env bash
# A base image for the Dockerfile where no container registry answers, made from Debian's
# packages: debootstrap a minimal bookworm (Python 3.11, its venv module, CA certificates),
# add this machine's CA bundle and point pip at it (the build reaches the package index
# through this machine's network, whose TLS may be re-signed), and commit it to buildah's
# store. Prints the image's name; an image of that name already there is kept.
#
#   tests/container/base_image.sh [NAME]     # root; needs debootstrap and buildah
#   (apt-get install -y debootstrap buildah)  # default NAME: localhost/kneegate-base:bookworm
set -euo pipefail
name=${1:-localhost/kneegate-base:bookworm}
if buildah inspect --type image "$name" >/dev/null 2>&1; then
    echo "$name"
    exit 0
fi
root=$(mktemp -d)
ctr=""
cleanup() {
    [ -n "$ctr" ] && buildah rm "$ctr" >/dev/null 2>&1
    rm -rf "$root"
}
trap cleanup EXIT
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    bookworm "$root" "${DEBIAN_MIRROR:-http://deb.debian.org/debian}" >&2
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
cp /etc/ssl/certs/ca-certificates.crt "$root"/etc/ssl/certs/ca-certificates.crt
printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' > "$root"/etc/pip.conf
ctr=$(buildah from scratch)
mnt=$(buildah mount "$ctr")
cp -a "$root"/. "$mnt"/
buildah umount "$ctr" >/dev/null
buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --cmd /bin/bash "$ctr"
buildah commit --quiet "$ctr" "$name" >/dev/null
echo "$name"
