#!/bin/sh
# The runtime part of every shardtrain image, run inside the image build:
# installs the Debian packages that own the shared libraries the binaries
# load (runtime-packages.txt, read off ldd by deploy/stage-binaries or the
# from-source build stage), sqlite3 for online backups of the state database,
# and creates the unprivileged user that owns the state directory.
#   image-runtime.sh DIR   (DIR holds runtime-packages.txt)
set -eu
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
# passwd for useradd: a minimal base (debootstrap minbase) lacks it.
xargs -a "$1/runtime-packages.txt" apt-get install -y -qq --no-install-recommends \
  sqlite3 passwd >/dev/null
rm -rf /var/lib/apt/lists/*
useradd --system --uid 10001 --user-group --home-dir /var/lib/shardtrain \
  --shell /usr/sbin/nologin shardtrain
mkdir -p /var/lib/shardtrain
chown shardtrain:shardtrain /var/lib/shardtrain
