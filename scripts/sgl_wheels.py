"""Where the SGLang wheels for a GPU machine without internet are, printed as one folder.

``scripts/pack_sglang.sh`` leaves them in ``.sgl/`` either as ``*.whl`` files or, smaller to carry, as
``.sgl/wheels.tar.xz``: each wheel unpacked into a folder of its own name, the folders in one xz tar
(the wheels' zip deflate gives 34 MiB, xz over their files 22 MiB). This prints ``.sgl`` when the wheels
are there as files, else unpacks the archive and zips each folder back into a wheel of the same name
and the same files (RECORD included) under the folder given (default ``/tmp/sgl-wheels``) and prints
that; nothing and exit status 1 when neither is there. With ``--install TARGET`` it also installs them
into TARGET the one way every GPU script does (pip, offline, no dependencies: the wheels are the whole
set; exit status 2 when pip fails), so that line lives here alone.

    python3 scripts/sgl_wheels.py [DEST]
    python3 scripts/sgl_wheels.py --install TARGET [DEST]
"""
import glob
import os
import subprocess
import sys
import tarfile
import zipfile


def wheels_folder(root=".sgl", dest="/tmp/sgl-wheels"):
    if glob.glob(os.path.join(root, "*.whl")):
        return root
    archive = os.path.join(root, "wheels.tar.xz")
    if not os.path.isfile(archive):
        return None
    unpacked = dest + ".unpacked"
    os.makedirs(unpacked, exist_ok=True)
    os.makedirs(dest, exist_ok=True)
    with tarfile.open(archive, "r:xz") as tar:
        if hasattr(tarfile, "data_filter"):  # Python 3.11.4 and later: no links or paths out of `unpacked`
            tar.extractall(unpacked, filter="data")
        else:
            tar.extractall(unpacked)
    for name in sorted(os.listdir(unpacked)):
        folder = os.path.join(unpacked, name)
        if not name.endswith(".whl") or not os.path.isdir(folder):
            continue
        with zipfile.ZipFile(os.path.join(dest, name), "w", zipfile.ZIP_STORED) as whl:
            for top, _, files in os.walk(folder):
                for f in sorted(files):
                    path = os.path.join(top, f)
                    whl.write(path, os.path.relpath(path, folder))
    return dest


def install(folder, target):
    """pip's offline install of every wheel in ``folder`` into ``target``; True when it succeeded."""
    wheels = sorted(glob.glob(os.path.join(folder, "*.whl")))
    return subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                           "--target", target, *wheels], stdout=sys.stderr).returncode == 0  # stdout: the folder only


if __name__ == "__main__":
    args = sys.argv[1:]
    target = None
    if args[:1] == ["--install"]:
        if len(args) < 2:
            sys.exit("usage: sgl_wheels.py --install TARGET [DEST]")
        target, args = args[1], args[2:]
    found = wheels_folder(dest=args[0] if args else "/tmp/sgl-wheels")
    if found is None:
        sys.exit(1)
    print(found)
    if target is not None and not install(found, target):
        sys.exit(2)
