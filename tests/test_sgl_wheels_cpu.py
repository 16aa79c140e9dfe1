"""scripts/sgl_wheels.py: SGLang's wheels carried to a GPU machine as one xz tar of unpacked wheels
(scripts/pack_sglang.sh) come back as wheels with the same files, which pip then installs."""

import os
import pathlib
import subprocess
import sys
import tarfile
import zipfile

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "sgl_wheels.py"
FILES = {"pkg/__init__.py": b"VALUE = 1\n", "pkg/data/table.bin": bytes(range(256)) * 3,
         "pkg-1.0.dist-info/METADATA": b"Name: pkg\nVersion: 1.0\n", "pkg-1.0.dist-info/RECORD": b"pkg/__init__.py,,\n"}


def _run(cwd, dest):
    return subprocess.run([sys.executable, str(SCRIPT), str(dest)], cwd=cwd, capture_output=True, text=True)


def _pack(root, name="pkg-1.0-py3-none-any.whl", files=FILES):
    """What pack_sglang.sh leaves in .sgl/: each wheel's files under a folder of its name, in one xz tar."""
    stage = root / "stage" / name
    for rel, data in files.items():
        (stage / rel).parent.mkdir(parents=True, exist_ok=True)
        (stage / rel).write_bytes(data)
    (root / ".sgl").mkdir()
    with tarfile.open(root / ".sgl" / "wheels.tar.xz", "w:xz") as tar:
        tar.add(root / "stage", arcname=".")
    return name


def test_archive_becomes_wheels_with_the_same_files(tmp_path):
    name = _pack(tmp_path)
    dest = tmp_path / "wheels"
    done = _run(tmp_path, dest)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(dest)
    assert sorted(os.listdir(dest)) == [name]
    with zipfile.ZipFile(dest / name) as whl:
        assert sorted(whl.namelist()) == sorted(FILES)
        assert {n: whl.read(n) for n in whl.namelist()} == FILES


def test_wheel_files_are_used_as_they_are(tmp_path):
    (tmp_path / ".sgl").mkdir()
    with zipfile.ZipFile(tmp_path / ".sgl" / "pkg-1.0-py3-none-any.whl", "w") as whl:
        whl.writestr("pkg/__init__.py", FILES["pkg/__init__.py"])
    done = _run(tmp_path, tmp_path / "unused")
    assert done.returncode == 0 and done.stdout.strip() == ".sgl"
    assert not (tmp_path / "unused").exists()


def test_nothing_carried_is_exit_status_1(tmp_path):
    done = _run(tmp_path, tmp_path / "w")
    assert done.returncode == 1 and done.stdout == ""


def test_install_puts_the_wheels_into_the_target(tmp_path):
    """--install: the wheels (here one real, minimal wheel packed as pack_sglang.sh packs) installed by pip
    into TARGET, offline; exit status 2 when pip fails."""
    name, files = "tiny-1.0-py3-none-any.whl", {
        "tiny/__init__.py": b"VALUE = 7\n",
        "tiny-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: tiny\nVersion: 1.0\n",
        "tiny-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        "tiny-1.0.dist-info/RECORD": b"tiny/__init__.py,,\ntiny-1.0.dist-info/METADATA,,\n"
                                     b"tiny-1.0.dist-info/WHEEL,,\ntiny-1.0.dist-info/RECORD,,\n"}
    _pack(tmp_path, name, files)
    site, dest = tmp_path / "site", tmp_path / "wheels"
    done = subprocess.run([sys.executable, str(SCRIPT), "--install", str(site), str(dest)], cwd=tmp_path,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(dest)
    assert (site / "tiny" / "__init__.py").read_bytes() == files["tiny/__init__.py"]

    (dest / name).write_bytes(b"not a zip")  # a broken wheel: pip fails, and so does the script
    (tmp_path / ".sgl" / name).write_bytes(b"not a zip")
    done = subprocess.run([sys.executable, str(SCRIPT), "--install", str(tmp_path / "site2")], cwd=tmp_path,
                          capture_output=True, text=True)
    assert done.returncode == 2 and done.stdout.strip() == ".sgl"
