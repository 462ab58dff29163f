"""Archive download against a local HTTP server: checksum, all-or-nothing extraction, no second
download, unsafe archives refused; and the one-line errors for missing or corrupt data."""

from __future__ import annotations

import hashlib
import io
import pickle
import signal
import socket
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Iterator
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
from helpers import load_scaled, write_md5sums

from dpresearch.data import download
from dpresearch.data.cifar import CIFAR10

FOLDER = "cifar-10-batches-py"


def write_fake_cifar10(root: Path, per_batch: int = 3) -> Path:
    """A tiny CIFAR-10 in the official layout: 5 training batches and a test batch of
    `per_batch` random images each, plus batches.meta."""
    folder = root / FOLDER
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for b, name in enumerate(names):
        content = {
            "batch_label": name,
            "labels": [(b + i) % 10 for i in range(per_batch)],
            "data": rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8),
            "filenames": [f"img_{i}.png" for i in range(per_batch)],
        }
        with open(folder / name, "wb") as f:
            pickle.dump(content, f, protocol=2)
    meta = {"num_cases_per_batch": per_batch, "label_names": [f"c{k}" for k in range(10)]}
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump(meta, f, protocol=2)
    write_md5sums(folder)
    return folder


def tar_gz(path: Path, add: dict[str, Path | bytes]) -> str:
    """Write a .tar.gz holding `add` (member name → directory/file to add, or raw bytes);
    returns its MD5."""
    with tarfile.open(path, "w:gz") as tar:
        for name, source in add.items():
            if isinstance(source, bytes):
                info = tarfile.TarInfo(name)
                info.size = len(source)
                tar.addfile(info, io.BytesIO(source))
            else:
                tar.add(source, arcname=name)
    return hashlib.md5(path.read_bytes()).hexdigest()


class Server:
    """Serves files from a directory on 127.0.0.1 (ephemeral port) and counts requests;
    `/truncated` announces more bytes than it sends, then hangs up; `/drip` sends one byte
    every 50 ms of the megabyte it announces (each read is quick, the download endless)."""

    def __init__(self, directory: Path) -> None:
        self.requests: list[str] = []
        server = self

        class Handler(SimpleHTTPRequestHandler):
            def do_GET(self) -> None:
                server.requests.append(self.path)
                if self.path == "/truncated":
                    self.send_response(200)
                    self.send_header("Content-Length", "100000")
                    self.end_headers()
                    self.wfile.write(b"x" * 1000)
                    self.close_connection = True
                    return
                if self.path == "/drip":
                    self.send_response(200)
                    self.send_header("Content-Length", str(1 << 20))
                    self.end_headers()
                    try:
                        for _ in range(1 << 20):
                            self.wfile.write(b"x")
                            self.wfile.flush()
                            time.sleep(0.05)
                    except OSError:  # the client hung up
                        pass
                    self.close_connection = True
                    return
                super().do_GET()

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(
            ("127.0.0.1", 0), partial(Handler, directory=str(directory))
        )
        self.httpd.daemon_threads = True
        self.base = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(autouse=True)
def no_proxy_for_localhost(monkeypatch: pytest.MonkeyPatch) -> None:
    # urllib honours http_proxy; a proxy cannot reach the test's local server.
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Server]:
    (tmp_path / "www").mkdir()
    server = Server(tmp_path / "www")
    yield server
    server.close()


@pytest.fixture
def good_archive(tmp_path: Path, served: Server) -> tuple[str, str]:
    """URL and MD5 of a well-formed fake cifar-10-python.tar.gz."""
    source = write_fake_cifar10(tmp_path / "src")
    md5 = tar_gz(tmp_path / "www" / "cifar-10-python.tar.gz", {FOLDER: source})
    return f"{served.base}/cifar-10-python.tar.gz", md5


def test_download_extracts_and_second_call_does_not_download(
    tmp_path: Path, served: Server, good_archive: tuple[str, str]
) -> None:
    url, md5 = good_archive
    root = tmp_path / "data"
    data = CIFAR10.load(root, download=True, url=url, md5=md5)
    assert data.num_train == 15 and data.test_targets.shape == (3,)
    assert data.label_names[3] == "c3"
    assert sorted(p.name for p in root.iterdir()) == [FOLDER]  # no archive, no staging dir
    assert len(served.requests) == 1
    again = CIFAR10.load(root, download=True, url=url, md5=md5)
    assert len(served.requests) == 1
    assert again.num_train == 15


def test_bad_checksum_leaves_nothing(
    tmp_path: Path, served: Server, good_archive: tuple[str, str]
) -> None:
    url, _ = good_archive
    root = tmp_path / "data"
    with pytest.raises(ValueError, match="MD5") as err:
        CIFAR10.load(root, download=True, url=url, md5="0" * 32)
    assert "\n" not in str(err.value)
    assert not root.exists()  # not even the directory the download would have gone to


@pytest.mark.parametrize("path", ["/missing.tar.gz", "/truncated"])
def test_failed_download_leaves_nothing(tmp_path: Path, served: Server, path: str) -> None:
    root = tmp_path / "data"
    with pytest.raises(ConnectionError) as err:
        download.ensure_extracted(root, download.CIFAR10_ARCHIVE, url=served.base + path)
    assert "\n" not in str(err.value)
    assert not root.exists()  # not even the directory the download would have gone to


def test_unreachable_server_gives_one_line_error(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ConnectionError, match="could not download CIFAR-10") as err:
        CIFAR10.load(tmp_path, download=True, url=f"http://127.0.0.1:{port}/x.tar.gz")
    assert "\n" not in str(err.value)
    assert list(tmp_path.iterdir()) == []


def test_interrupted_extraction_leaves_nothing(
    tmp_path: Path, good_archive: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, md5 = good_archive

    def interrupted(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(download, "safe_extract", interrupted)
    root = tmp_path / "data"
    with pytest.raises(KeyboardInterrupt):
        download.ensure_extracted(root, download.CIFAR10_ARCHIVE, url=url, md5=md5)
    assert not root.exists()


@pytest.mark.parametrize("kind", ["traversal", "absolute", "symlink"])
def test_unsafe_archive_is_refused(tmp_path: Path, served: Server, kind: str) -> None:
    archive = tmp_path / "www" / "evil.tar.gz"
    if kind == "symlink":
        with tarfile.open(archive, "w:gz") as tar:
            info = tarfile.TarInfo(f"{FOLDER}/data_batch_1")
            info.type = tarfile.SYMTYPE
            info.linkname = "/etc/passwd"
            tar.addfile(info)
        md5 = hashlib.md5(archive.read_bytes()).hexdigest()
    else:
        name = "../evil.txt" if kind == "traversal" else str(tmp_path / "evil.txt")
        md5 = tar_gz(archive, {name: b"pwned"})
    root = tmp_path / "data"
    with pytest.raises(ValueError, match="unsafe member") as err:
        download.ensure_extracted(
            root, download.CIFAR10_ARCHIVE, url=f"{served.base}/evil.tar.gz", md5=md5
        )
    assert "\n" not in str(err.value)
    assert not root.exists()  # not even the directory the download would have gone to
    assert not (tmp_path / "evil.txt").exists()


def test_archive_without_expected_folder_is_refused(tmp_path: Path, served: Server) -> None:
    md5 = tar_gz(tmp_path / "www" / "other.tar.gz", {"something-else/readme.txt": b"hi"})
    root = tmp_path / "data"
    with pytest.raises(ValueError, match=f"no {FOLDER}/ folder"):
        download.ensure_extracted(
            root, download.CIFAR10_ARCHIVE, url=f"{served.base}/other.tar.gz", md5=md5
        )
    assert not root.exists()


def test_missing_data_without_download_names_the_fix(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError) as err:
        CIFAR10.load(tmp_path / "nowhere")
    message = str(err.value)
    assert "\n" not in message
    assert "data.download=true" in message and FOLDER in message and "nowhere" in message


def test_missing_file_names_the_fix(tmp_path: Path) -> None:
    folder = write_fake_cifar10(tmp_path)
    (folder / "data_batch_3").unlink()
    with pytest.raises(FileNotFoundError, match="data_batch_3 is missing") as err:
        CIFAR10.load(tmp_path)
    assert "\n" not in str(err.value) and "data.download=true" in str(err.value)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "wrong_shape"])
def test_corrupt_file_names_the_fix(tmp_path: Path, damage: str) -> None:
    folder = write_fake_cifar10(tmp_path)
    path = folder / "test_batch"
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[:500])
    elif damage == "garbage":
        path.write_bytes(b"not a pickle at all")
    else:
        content = {"labels": [0, 1], "data": np.zeros((2, 1024), dtype=np.uint8)}
        path.write_bytes(pickle.dumps(content))
    with pytest.raises(ValueError, match="test_batch is corrupt") as err:
        CIFAR10.load(tmp_path, verify=False)  # the reader's own checks
    assert "\n" not in str(err.value) and "data.download=true" in str(err.value)


def test_dripping_server_is_stopped_at_the_deadline(tmp_path: Path, served: Server) -> None:
    """Acceptance F: each read returns within the per-read timeout, yet the download ends at
    its overall deadline with one line, leaving nothing behind."""
    root = tmp_path / "data"
    start = time.monotonic()
    with pytest.raises(ConnectionError, match="deadline, data.download_timeout_s") as err:
        download.ensure_extracted(
            root, download.CIFAR10_ARCHIVE, url=f"{served.base}/drip", timeout_s=60, deadline_s=2
        )
    took = time.monotonic() - start
    assert 2 <= took < 2 + load_scaled(5), f"ended after {took:.1f} s"
    assert "\n" not in str(err.value)
    assert not root.exists()


def test_sigterm_mid_download_leaves_nothing(tmp_path: Path, served: Server) -> None:
    """Acceptance F: SIGTERM to `python -m dpresearch.train` while it downloads: one line,
    exit 143, no data directory, no run directory."""
    from helpers import cli_env

    root = tmp_path / "data"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dpresearch.train",
            "data=cifar10",
            "data.download=true",
            f"data.root={root}",
            f"+data.url={served.base}/drip",
        ],
        cwd=tmp_path,
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + load_scaled(120)
        while not list(root.glob(".cifar-10-batches-py.tmp-*/archive.tar.gz")):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the download never started"
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=load_scaled(60))
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert [ln for ln in err.splitlines() if ln.strip()] == [
        "error: interrupted before the run started; nothing was written"
    ]
    assert not root.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["www"]  # the server's; no outputs/


def flip_a_byte(path: Path) -> None:
    """Change one pixel byte near the end (the pickle still loads; only the image differs)."""
    data = bytearray(path.read_bytes())
    data[-200] ^= 0x01
    path.write_bytes(bytes(data))


def test_flipped_byte_in_a_downloaded_file_is_one_line_naming_it(
    tmp_path: Path, served: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Acceptance F. The download records its files as verified (a mirror's archive with no
    per-file list: its checksum vouches for them); later loads only compare sizes and times,
    until a file changes."""
    from dpresearch.data import verify

    source = write_fake_cifar10(tmp_path / "src")
    (source / "MD5SUMS").unlink()
    md5 = tar_gz(tmp_path / "www" / "mirror.tar.gz", {FOLDER: source})
    url = f"{served.base}/mirror.tar.gz"
    root = tmp_path / "data"
    CIFAR10.load(root, download=True, url=url, md5=md5)
    assert (root / FOLDER / verify.MARKER).exists()

    def no_hashing(path: Path) -> str:
        raise AssertionError(f"hashed {path} again")

    with monkeypatch.context() as patched:
        patched.setattr(verify, "md5_of", no_hashing)
        CIFAR10.load(root)  # verified once: the marker answers
    flip_a_byte(root / FOLDER / "data_batch_2")
    with pytest.raises(ValueError) as err:
        CIFAR10.load(root)
    message = str(err.value)
    assert "\n" not in message
    assert f"{root / FOLDER / 'data_batch_2'} is corrupt or changed" in message
    assert "its verified download" in message


def test_md5sums_beside_the_folder_is_the_reference(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A subset shipped as `<root>/MD5SUMS` + `<root>/cifar-10-batches-py/` (the layout of
    ../shared/data/cifar10-subset): its files verify against that list, not the official one."""
    folder = write_fake_cifar10(tmp_path)
    (folder / "MD5SUMS").rename(tmp_path / "MD5SUMS")
    assert CIFAR10.load(tmp_path).num_train == 15
    flip_a_byte(folder / "test_batch")
    with pytest.raises(ValueError, match="test_batch is corrupt or changed.*the MD5SUMS beside"):
        CIFAR10.load(tmp_path)
    assert CIFAR10.load(tmp_path, verify=False).num_train == 15  # the escape hatch


def test_unlisted_variant_is_refused_against_the_official_md5s(tmp_path: Path) -> None:
    folder = write_fake_cifar10(tmp_path)
    (folder / "MD5SUMS").unlink()
    with pytest.raises(ValueError, match="expected c99cafc152244af753f735de768cd75f"):
        CIFAR10.load(tmp_path)


def test_read_only_folder_keeps_its_marker_in_the_user_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shared, read-only copy is never written to: the marker goes to the cache."""
    from dpresearch.data import verify

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    folder = write_fake_cifar10(tmp_path / "shared")
    folder.chmod(0o555)
    try:
        CIFAR10.load(tmp_path / "shared")
        assert not (folder / verify.MARKER).exists()
        assert len(list((tmp_path / "cache" / "dpresearch" / "verified").glob("*.json"))) == 1
    finally:
        folder.chmod(0o755)
