#!/usr/bin/env python3
"""Sets each tracked file's modification time to the time of the last
commit that changed it (and each directory's to its newest entry's).

Cargo decides a crate of the workspace is stale when one of its sources is
newer than its last build. A fresh clone gives every file the clone's time,
so a build cache shared between clones (scripts/test.sh's) would rebuild
every crate; with commit times, it rebuilds those whose files changed since
the cached build. Run only on a clean checkout: an edited file would get
the older time of its last commit.
  usage: scripts/restore-mtimes.py   (in the repository)"""
import os
import subprocess
import sys

root = subprocess.run(["git", "rev-parse", "--show-toplevel"], check=True,
                      capture_output=True, text=True).stdout.strip()
os.chdir(root)
if subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], check=True,
                  capture_output=True, text=True).stdout.strip():
    sys.exit("restore-mtimes: the checkout has changes; leaving its times alone")
tracked = set(subprocess.run(["git", "ls-files", "-z"], check=True, capture_output=True,
                             text=True).stdout.split("\0")) - {""}
log = subprocess.run(["git", "log", "--format=format:@%ct", "--name-only", "--no-renames", "-z"],
                     check=True, capture_output=True, text=True).stdout
times = {}
when = None
for item in log.replace("\n", "\0").split("\0"):
    if item.startswith("@") and item[1:].isdigit():
        when = int(item[1:])
    elif item and when is not None and item in tracked and item not in times:
        times[item] = when
dirs = {}
for path, t in times.items():
    os.utime(path, (t, t), follow_symlinks=False)
    d = os.path.dirname(path)
    while True:
        dirs[d] = max(dirs.get(d, 0), t)
        if not d:
            break
        d = os.path.dirname(d)
for d, t in dirs.items():
    if d:
        os.utime(d, (t, t))
print(f"restore-mtimes: {len(times)} files, {len(dirs)} directories", file=sys.stderr)
