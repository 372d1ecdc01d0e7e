"""start/linux/scm_rights.py: the one receiving side of descriptors passed over a Unix socket, as
the start server, its workers and the ldconfig helper use it (their own tests go through it)."""

from __future__ import annotations

import fcntl
import os
import socket

import pytest

from oci_gpu_hook.start.linux import scm_rights


@pytest.fixture
def pair():
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    yield ours, theirs
    ours.close()
    theirs.close()


def test_the_message_and_its_descriptors_come_together(pair):
    ours, theirs = pair
    r, w = os.pipe()
    try:
        socket.send_fds(theirs, [b"go"], [w])
        message, fds, flags = scm_rights.receive(ours, 16, 1)
        assert (message, len(fds), flags) == (b"go", 1, 0)
        os.write(fds[0], b"x")  # the same pipe, through the received copy
        os.close(fds[0])
        assert os.read(r, 1) == b"x"
    finally:
        os.close(r)
        os.close(w)


@pytest.mark.parametrize("flags, cloexec", [(0, False), (socket.MSG_CMSG_CLOEXEC, True)])
def test_the_callers_flags_reach_the_kernel(pair, flags, cloexec):
    """What socket.recv_fds does not do: MSG_CMSG_CLOEXEC makes what comes close-on-exec."""
    ours, theirs = pair
    r, w = os.pipe()
    try:
        socket.send_fds(theirs, [b""], [r])
        _, fds, _ = scm_rights.receive(ours, 16, 1, flags)
        assert bool(fcntl.fcntl(fds[0], fcntl.F_GETFD) & fcntl.FD_CLOEXEC) is cloexec
        os.close(fds[0])
    finally:
        os.close(r)
        os.close(w)


def test_it_never_waits_when_told_not_to(pair):
    with pytest.raises(BlockingIOError):
        scm_rights.receive(pair[0], 16, 1, socket.MSG_DONTWAIT)


def test_descriptors_beyond_the_most_are_flagged_and_closed_by_the_kernel(pair):
    """Room for exactly `most`: an extra one is not received, and not left open anywhere (the
    pipe whose write end it was sees its end once the sender's copy is closed)."""
    ours, theirs = pair
    r, w = os.pipe()
    kept_r, kept_w = os.pipe()
    try:
        socket.send_fds(theirs, [b"two"], [kept_w, w])
        os.close(w)
        w = None
        message, fds, flags = scm_rights.receive(ours, 16, 1)
        assert message == b"two" and len(fds) == 1 and flags & socket.MSG_CTRUNC
        os.close(fds[0])
        os.set_blocking(r, False)  # a write end kept anywhere: BlockingIOError, not a hang
        assert os.read(r, 1) == b""  # no write end left: the extra was closed, not kept
    finally:
        for fd in (r, w, kept_r, kept_w):
            if fd is not None:
                os.close(fd)


def test_a_message_longer_than_the_room_is_flagged(pair):
    ours, theirs = pair
    theirs.send(b"x" * 32)
    message, fds, flags = scm_rights.receive(ours, 8, 1)
    assert (message, fds) == (b"x" * 8, []) and flags & socket.MSG_TRUNC
