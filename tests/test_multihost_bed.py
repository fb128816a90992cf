"""The namespace test bed itself (tests/multihost.py): hosts that resolve each other, shaped links, nothing left."""

from __future__ import annotations

import os
import subprocess

import pytest

from multihost import ETC_NETNS, Hosts, NamespaceUnavailable, _namespaces, in_host


def _in(bed: Hosts, i: int, *cmd: str) -> str:
    return subprocess.run(in_host(bed.hosts[i], bed.hostname(i), list(cmd)), capture_output=True, text=True,
                          check=True, timeout=30).stdout


def test_hosts_reach_each_other_by_name_over_shaped_links_and_leave_nothing(namespace_hosts):
    bed = namespace_hosts(2)
    assert _in(bed, 1, "hostname").strip() == "h1"
    assert _in(bed, 1, "getent", "hosts", "h0").split()[0] == bed.addr(0)
    for i in range(bed.n):  # both ends of every link
        assert "rate 1Gbit" in _in(bed, i, "tc", "qdisc", "show", "dev", "eth0")
        assert "rate 1Gbit" in subprocess.run(["ip", "netns", "exec", bed.switch, "tc", "qdisc", "show", "dev", f"p{i}"],
                                              capture_output=True, text=True, check=True).stdout
    # Host 0 reaches host 1 over its link; its own address stays on its loopback (no other host sees it).
    assert _in(bed, 0, "ip", "route", "get", bed.addr(1)).split()[2] == "eth0"
    assert " dev lo " in _in(bed, 0, "ip", "route", "get", bed.addr(0))
    bed.close()
    assert not set(bed.hosts + [bed.switch]) & set(_namespaces())
    assert not any((ETC_NETNS / ns).exists() for ns in bed.hosts)


def test_a_machine_without_namespaces_skips_in_one_line(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(NamespaceUnavailable, match="^network namespaces need root$"):
        Hosts(2)
