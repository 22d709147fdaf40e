"""Gloo binds the interface of the rank's advertised address, never a
silent loopback: an address no interface holds is an error naming it."""

from __future__ import annotations

import os

import pytest

from kvloom.worker.v1 import worker_pb2
from workerd.distributed.gloo_interface import GLOO_IFNAME_ENV, interface_for, pin_gloo_interface
from workerd.worker import CommandError, Worker


def test_loopback_is_lo_and_each_interface_address_is_its_own():
    assert interface_for("127.0.0.1") == "lo"
    assert interface_for("localhost") == "lo"
    # All of 127.0.0.0/8 arrives on lo, which lists 127.0.0.1 only.
    assert interface_for("127.0.0.2") == "lo"


@pytest.mark.parametrize("host", ["192.0.2.77", "203.0.113.9"])  # TEST-NET: on no interface
def test_an_address_on_no_interface_is_refused_naming_it(host):
    with pytest.raises(ValueError, match=f"holds the advertised address {host}"):
        interface_for(host)


def test_a_name_that_does_not_resolve_is_refused():
    with pytest.raises(ValueError, match="does not resolve"):
        interface_for("no-such-host.invalid")


def test_pinning_sets_gloos_interface(monkeypatch):
    monkeypatch.delenv(GLOO_IFNAME_ENV, raising=False)
    assert pin_gloo_interface("127.0.0.1") == "lo" == os.environ[GLOO_IFNAME_ENV]


def test_a_worker_advertising_a_foreign_address_fails_init_distributed(monkeypatch):
    monkeypatch.delenv(GLOO_IFNAME_ENV, raising=False)
    worker = Worker("cpu", advertise_host="192.0.2.77")
    cmd = worker_pb2.InitDistributed(rank=0, world_size=2, tensor_parallel_size=2,
                                     pipeline_parallel_size=1, master_addr="127.0.0.1",
                                     master_port=1, timeout_s=1)
    with pytest.raises(CommandError, match="192.0.2.77"):
        worker.init_distributed(cmd)
    assert GLOO_IFNAME_ENV not in os.environ  # nothing half set
