"""The start journal's recovery, against what whoever owns its directory can do there without
writing a file of the hook's (a uid 0 without capabilities: tests/security/test_untrusted_records.py
plants a journal of its own): rename the hook's journals, put a FIFO where one belongs."""

from __future__ import annotations

import os
import threading

import pytest

from oci_gpu_hook.start import settings
from oci_gpu_hook.start.linux.journal import Journal
from oci_gpu_hook.start.linux.rootfs import Rootfs


def make_rootfs(path) -> str:
    os.makedirs(path / "etc")
    (path / "etc" / "file").write_text("the image's own\n")
    return str(path)


def prefix(rootfs: str) -> str:
    st = os.stat(rootfs)
    return f"{st.st_dev:x}-{st.st_ino:x}."


def killed_apply(pending: str, rootfs: str, *intents) -> str:
    """A journal as an apply killed after saying intents leaves it; its name."""
    opened = Rootfs(rootfs)
    try:
        journal = Journal.start(pending, opened)
        for kind, path in intents:
            journal.intend(kind, path)
        os.close(journal.fd)  # killed: no close(), the journal stays, its lock goes with the process
        os.close(journal.dir_fd)
    finally:
        opened.close()
    return journal.name


def start(pending: str, rootfs: str) -> list:
    """Another start of rootfs (its recovery); what it said."""
    said = []
    opened = Rootfs(rootfs)
    try:
        Journal.start(pending, opened, said.append).close()
    finally:
        opened.close()
    return said


def test_the_journal_is_the_hooks_own_file(tmp_path):
    pending = str(tmp_path / "pending")
    name = killed_apply(pending, make_rootfs(tmp_path / "a"), ("temp", "/etc/file"))
    st = os.stat(os.path.join(pending, name))
    assert settings.trusted(st) and st.st_uid in settings.cache_owners()


def test_a_journal_renamed_to_another_rootfs_is_not_recovered_there(tmp_path):
    """Whoever owns the directory may rename what is in it, not change a journal's contents: the
    journal of rootfs a, under b's name, removes nothing from b. Back under a's, it is a's."""
    pending = str(tmp_path / "pending")
    a, b = make_rootfs(tmp_path / "a"), make_rootfs(tmp_path / "b")
    name = killed_apply(pending, a, ("temp", "/etc/file"))
    renamed = prefix(b) + "1"
    os.rename(os.path.join(pending, name), os.path.join(pending, renamed))
    assert start(pending, b) == [f"{renamed}: a journal of another rootfs (renamed); not acted on"]
    assert os.path.exists(os.path.join(b, "etc/file")) and os.listdir(pending) == [renamed]
    os.rename(os.path.join(pending, renamed), os.path.join(pending, name))
    assert start(pending, a) == []
    assert not os.path.exists(os.path.join(a, "etc/file")) and os.listdir(pending) == []


def test_a_fifo_among_the_journals_holds_no_start(tmp_path):
    """A FIFO named as a journal of the rootfs: opened without waiting for a writer, and said."""
    pending = tmp_path / "pending"
    pending.mkdir(mode=0o700)
    rootfs = make_rootfs(tmp_path / "a")
    fifo = pending / (prefix(rootfs) + "1")
    os.mkfifo(fifo, 0o644)
    said = []
    worker = threading.Thread(target=lambda: said.extend(start(str(pending), rootfs)), daemon=True)
    worker.start()
    worker.join(60)  # a generous bound: an open that waits for a writer never returns by itself
    if worker.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # lets the blocked open return
        pytest.fail("a start waited on a FIFO among the journals")
    assert said == [f"{fifo.name}: not a journal the hook wrote (not a regular file); not acted on"]
