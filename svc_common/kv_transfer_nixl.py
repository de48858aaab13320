"""The nixl transfer path's NIXL side: one agent per process, its pool registered once, a prefill's pool
opened from its share, and READs of descriptor lists (one row per layer, part and run of consecutive pages).

    prefill process                                    decode process
    NixlAgent(name); export_nixl_share(pool, agent)    NixlAgent(name); register the pool (once)
        --KVShare: metadata, address + size per tensor (gRPC, once)-->
                                                       open_nixl_share(share, pool, agent) -> NixlView
    pool writes; Fence.wait()  --KVPageRefs-->         NixlAgent.read: one READ of a batch's descriptors
                                                       (decode_svc/kv_nixl_reads.py), polled to DONE on a
                                                       writer thread
                               <--ReleaseTransfer--    after every READ completed (and was checked)

The decode addresses remote pages only through a ``NixlView``: every tensor of the share checked for this
pool's page geometry (``check_share``) and for exactly ``num_pages`` rows of bytes at its address, so a page
id checked against ``num_pages`` always lies inside the region the prefill registered.

Invariant of ``NixlAgent.read``: it returns (or raises) only once its transfer handle is released, and the
handle is released only once NIXL no longer writes into the local pages (DONE, ERR, or cancelled by the
release), so the caller may free the destination pages right after.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.kv_pool import KVPool
from nvfp4_serve_proto import prefill_pb2
from svc_common.kv_transfer_ipc import check_share, describe_tensors, page_runs, pool_rows

log = logging.getLogger(__name__)

PARTS = ("k", "k_sf", "v", "v_sf")
POLL_S = 0.00005  # between two checks of a transfer's state (writer threads only, never the event loop): each
# check progresses UCX, which picks up at most UCX_CUDA_IPC_MAX_POLL copy completions per progress
_SERVE_POLL_S = 0.0005  # the prefill's UCX progress interval while transfers are open
_STUCK_LOG_S = 10.0  # a handle NIXL cannot cancel is waited for; logged at this interval
# UCX defaults this to "auto", which turns cuda_ipc reads (a NIXL READ is a UCX get) off unless NVML reports an
# active NVLink: two processes on one GPU, or GPUs joined over PCIe, then move VRAM through host memory at well
# under 1 GB/s (UCX's cuda_ipc_iface.c; NIXL's later releases set it themselves). Set before UCX starts, unless
# the environment already says otherwise.
# UCX_CUDA_IPC_MAX_POLL (default 16) caps the copy completions one progress picks up, and one READ of a run of
# pages of every part and layer is 100+ copies (each descriptor may go out on two rails).
_UCX_DEFAULTS = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y", "UCX_CUDA_IPC_MAX_POLL": "1024"}


class NixlUnavailable(RuntimeError):
    """NIXL cannot be imported, or its UCX agent cannot start."""


class NixlTransferError(RuntimeError):
    """A READ ended in ERR, did not complete in time, or was stopped."""


def mem_type(device: torch.device) -> tuple[str, int]:
    """NIXL's memory type and device id of tensors on ``device``."""
    if device.type == "cuda":
        return "VRAM", device.index if device.index is not None else torch.cuda.current_device()
    return "DRAM", 0


def _pool_tensors(pool: KVPool) -> list[tuple[int, str, torch.Tensor]]:
    return [(i, part, t) for i, lkv in enumerate(pool.layers)
            for part, t in zip(PARTS, (lkv.k, lkv.k_sf, lkv.v, lkv.v_sf), strict=True) if t is not None]


class NixlAgent:
    """This process's NIXL agent (UCX backend) with one KV pool registered. Thread-safe: remote agents are
    added under a lock; reads run concurrently on writer threads, each with its own handle.

    UCX progress: the READ initiator (the decode) progresses its worker while it polls its transfers. The
    target (the prefill) must progress its worker to serve reads over tcp/shm: ``serve_begin`` /
    ``serve_end`` bracket each transfer it holds pages for, and a thread of this agent polls NIXL every
    ``_SERVE_POLL_S`` while any is open. (NIXL's own progress thread busy-polls a core even when idle.)"""

    def __init__(self, name: str, pool: KVPool):
        for key, value in _UCX_DEFAULTS.items():
            os.environ.setdefault(key, value)
        try:
            from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
        except Exception as e:  # noqa: BLE001 - any import failure (missing wheel, missing libucx) is "no NIXL"
            raise NixlUnavailable(f"cannot import nixl: {type(e).__name__}: {e}") from None
        try:
            self.agent = nixl_agent(name, nixl_agent_config(  # STRICT: several threads call this agent
                enable_prog_thread=False, backends=["UCX"], sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT))
        except Exception as e:  # noqa: BLE001
            raise NixlUnavailable(f"cannot start a NIXL agent with the UCX backend: {type(e).__name__}: {e}") from None
        self.name = name
        self.pool = pool
        self.mem_type, self.device_id = mem_type(pool.device)
        tensors = [t for _, _, t in _pool_tensors(pool)]
        if any(not t.is_contiguous() for t in tensors):
            raise NixlUnavailable("the KV pool's tensors are not contiguous: NIXL needs one region per tensor")
        try:
            self._registered = self.agent.register_memory(tensors)  # each tensor once, for this process's life
        except Exception as e:  # noqa: BLE001
            raise NixlUnavailable(f"NIXL cannot register the KV pool ({self.mem_type}): {type(e).__name__}: "
                                  f"{e}") from None
        self._remotes: dict[str, bytes] = {}  # agent name -> metadata it was added with
        self._lock = threading.Lock()
        self._num_serving = 0  # transfers whose source pages peers may read now (prefill side)
        self._serving = threading.Condition(self._lock)
        self._server: threading.Thread | None = None

    def serve_begin(self) -> None:
        """A transfer whose pages peers read is open: progress UCX until its ``serve_end``."""
        with self._serving:
            self._num_serving += 1
            if self._server is None:
                self._server = threading.Thread(target=self._serve, name="nixl-progress", daemon=True)
                self._server.start()
            self._serving.notify()

    def serve_end(self) -> None:
        with self._serving:
            self._num_serving -= 1

    def _serve(self) -> None:
        while True:
            with self._serving:
                self._serving.wait_for(lambda: self._num_serving > 0)
            self.agent.get_new_notifs()  # progresses the UCX worker (serves the peers' READs)
            time.sleep(_SERVE_POLL_S)

    @property
    def metadata(self) -> bytes:
        return self.agent.get_agent_metadata()

    def add_remote(self, name: str, metadata: bytes) -> str:
        """Load a remote agent (once per name; the same name with other metadata is refused). Returns its name.
        Raises ValueError when the metadata names another agent or NIXL refuses it."""
        with self._lock:
            known = self._remotes.get(name)
            if known is not None:
                if known != metadata:
                    raise ValueError(f"NIXL agent {name[:40]!r} is already loaded with other metadata")
                return name
            try:
                loaded = self.agent.add_remote_agent(metadata)
            except Exception as e:  # noqa: BLE001 - peer bytes NIXL cannot parse
                raise ValueError(f"NIXL refuses the agent metadata: {type(e).__name__}: {e}") from None
            loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
            if loaded != name:
                self.agent.remove_remote_agent(loaded)
                raise ValueError(f"the agent metadata names {loaded[:40]!r}, the share says {name[:40]!r}")
            self._remotes[name] = metadata
            return name

    def check_remote(self, remote: str, regions: np.ndarray, remote_mem_type: str) -> None:
        """ValueError unless every region (rows: address, bytes, device id) lies in memory ``remote`` registered
        (NIXL prepares a descriptor list of them against the remote's metadata)."""
        try:
            handle = self.agent.prep_xfer_dlist(remote, regions, remote_mem_type)
        except Exception as e:  # noqa: BLE001 - NIXL_ERR_NOT_FOUND: some region is not registered there
            raise ValueError(f"the shared regions are not all registered by NIXL agent {remote[:40]!r}: "
                             f"{type(e).__name__}: {e}") from None
        self.agent.release_dlist_handle(handle)

    def remove_remote(self, name: str) -> None:
        with self._lock:
            if self._remotes.pop(name, None) is not None:
                self.agent.remove_remote_agent(name)

    def read(self, remote: str, local: np.ndarray, remote_descs: np.ndarray, remote_mem_type: str,
             timeout_s: float, stop: threading.Event, descs_per_read: int = 0, poll_s: float = POLL_S) -> int:
        """MUTATES local memory: READs of ``remote_descs`` (rows: address, bytes, device id on ``remote``) into
        ``local`` (rows of this process's registered memory), ``descs_per_read`` rows each (0: one READ), all
        posted before any is waited for; polled every ``poll_s`` (0: no sleep) for up to ``timeout_s`` or
        until ``stop`` is set. Returns the rounds of checks it took. Raises NixlTransferError; every handle
        made is released before it returns or raises (see the module's invariant)."""
        n = len(local)
        if n != len(remote_descs) or n == 0:
            raise NixlTransferError(f"a read needs as many local as remote descriptors (>= 1): {n} and "
                                    f"{len(remote_descs)}")
        if descs_per_read < 0 or poll_s < 0:
            raise ValueError(f"descs_per_read and poll_s must be >= 0, got {descs_per_read} and {poll_s}")
        step = descs_per_read or n
        handles: list = []
        try:
            for i in range(0, n, step):
                ldl = self.agent.get_xfer_descs(local[i:i + step], self.mem_type)
                rdl = self.agent.get_xfer_descs(remote_descs[i:i + step], remote_mem_type)
                try:
                    handles.append(self.agent.initialize_xfer("READ", ldl, rdl, remote))
                except Exception as e:  # noqa: BLE001 - e.g. addresses outside what the remote registered
                    raise NixlTransferError(f"NIXL cannot set up the read: {type(e).__name__}: {e}") from None
            error, rounds = self._post_and_wait(handles, timeout_s, stop, poll_s)
        finally:
            released = self._release_all(handles)  # before any error leaves: NIXL writes no page after this
        if error or released:
            raise NixlTransferError(f"NIXL read from {remote[:40]}: {error}" if error else released)
        return rounds

    def _release_all(self, handles: list) -> str:
        """Release every handle (each waited for where NIXL cannot cancel it). Returns '' or the first failure."""
        first = ""
        for handle in handles:
            try:
                self._release(handle)
            except NixlTransferError as e:  # the others are still released
                first = first or str(e)
        return first

    def _post_and_wait(self, handles: list, timeout_s: float, stop: threading.Event,
                       poll_s: float) -> tuple[str, int]:
        """Post every handle's READ, then poll until all are DONE. Returns ('' or why they are not, the rounds
        of checks)."""
        rounds = 0
        try:
            pending = []
            for h in handles:
                state = self.agent.transfer(h)
                if state == "PROC":
                    pending.append(h)
                elif state != "DONE":
                    return f"ended in state {state}", rounds
            deadline = time.monotonic() + timeout_s
            while pending:
                if stop.is_set():
                    return "stopped (the transfer failed or was cancelled)", rounds
                if time.monotonic() > deadline:
                    return f"not complete within {timeout_s:g} s", rounds
                time.sleep(poll_s)
                rounds += 1
                still = []
                for h in pending:
                    state = self.agent.check_xfer_state(h)  # each check progresses the UCX worker
                    if state == "PROC":
                        still.append(h)
                    elif state != "DONE":
                        return f"ended in state {state}", rounds
                pending = still
        except Exception as e:  # noqa: BLE001
            return f"{type(e).__name__}: {e}", rounds
        return "", rounds

    def _release(self, handle) -> None:
        """Release ``handle``; one NIXL cannot cancel yet is waited for (it may still write local pages)."""
        t0 = time.monotonic()
        while True:
            try:
                self.agent.release_xfer_handle(handle)
                return
            except Exception as e:  # noqa: BLE001 - "cannot cancel": wait for the transfer, then release
                state = self.agent.check_xfer_state(handle)
                if state != "PROC" and time.monotonic() - t0 > 1.0:
                    raise NixlTransferError(f"NIXL cannot release a {state} transfer handle: {e}") from None
                if time.monotonic() - t0 > _STUCK_LOG_S:
                    log.warning("a NIXL read cannot be cancelled; waiting for it before its pages are freed")
                    t0 = time.monotonic()
                time.sleep(0.001)


# -- prefill side ----------------------------------------------------------------------------------------
def export_nixl_share(pool: KVPool, agent: NixlAgent) -> prefill_pb2.KVShare:
    """The nixl fields of a KVShare (tensors with address and size, agent metadata, memory type) of ``pool``,
    registered with ``agent``; the caller adds endpoint, share id and layout."""
    tensors = describe_tensors(pool)
    by_key = {(i, part): t for i, part, t in _pool_tensors(pool)}
    for st in tensors:
        t = by_key[(st.layer, st.part)]
        st.address, st.num_bytes = t.data_ptr(), t.numel() * t.element_size()
    return prefill_pb2.KVShare(num_pages=pool_rows(pool), tensors=tensors, nixl_metadata=agent.metadata,
                               nixl_agent=agent.name, nixl_mem_type=agent.mem_type, nixl_device_id=agent.device_id)


# -- decode side -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RemoteTensor:
    address: int  # first byte of page 0 in the prefill process
    page_bytes: int


@dataclass(frozen=True)
class NixlView:
    """A prefill's pool as this decode's agent reads it: ``layers[i][part]`` for every part of this pool."""

    num_pages: int
    remote: str  # the prefill's agent name, loaded into the local agent
    mem_type: str
    device_id: int
    layers: tuple[dict[str, RemoteTensor], ...]


_MAX_ADDRESS = 1 << 63  # addresses and sizes stay int64 in descriptor arithmetic (user space is far below)


def check_nixl_share(share: prefill_pb2.KVShare, pool: KVPool) -> tuple[dict[str, RemoteTensor], ...]:
    """Raise ValueError unless ``share`` is a nixl share of ``pool``'s geometry: ``check_share``, then every
    tensor exactly ``num_pages`` pages of bytes at a nonzero address, no two overlapping, a known memory type."""
    check_share(share, pool)
    if not share.nixl_metadata or not share.nixl_agent:
        raise ValueError("the share carries no NIXL agent metadata")
    if share.nixl_mem_type not in ("DRAM", "VRAM") or share.nixl_device_id < 0:
        raise ValueError(f"the share's memory type {share.nixl_mem_type[:16]!r} device {share.nixl_device_id} "
                         "is not DRAM or VRAM with a device id >= 0")
    layers: list[dict[str, RemoteTensor]] = [{} for _ in range(pool.num_layers)]
    spans = []
    for st in share.tensors:
        t = getattr(pool.layers[st.layer], st.part)
        page_bytes = t[0].numel() * t.element_size()
        if st.num_bytes != share.num_pages * page_bytes:
            raise ValueError(f"shared tensor ({st.layer}, {st.part!r}) has {st.num_bytes} bytes, "
                             f"{share.num_pages} pages need {share.num_pages * page_bytes}")
        if not 0 < st.address < _MAX_ADDRESS - st.num_bytes:
            raise ValueError(f"shared tensor ({st.layer}, {st.part!r}) lies at address {st.address:#x}, "
                             "outside the address space")
        layers[st.layer][st.part] = RemoteTensor(st.address, page_bytes)
        spans.append((st.address, st.address + st.num_bytes))
    spans.sort()
    if any(b > c for (_, b), (c, _) in itertools.pairwise(spans)):
        raise ValueError("shared tensors overlap")
    return tuple(layers)


def open_nixl_share(share: prefill_pb2.KVShare, pool: KVPool, agent: NixlAgent) -> NixlView:
    """Check ``share`` (``check_nixl_share``), load its agent into ``agent`` and check with NIXL that every
    tensor's region is memory that agent registered. Raises ValueError (the agent is not kept then)."""
    layers = check_nixl_share(share, pool)
    remote = agent.add_remote(share.nixl_agent, share.nixl_metadata)
    regions = np.array([[st.address, st.num_bytes, share.nixl_device_id] for st in share.tensors], dtype=np.uint64)
    try:
        agent.check_remote(remote, regions, share.nixl_mem_type)
    except ValueError:
        agent.remove_remote(remote)
        raise
    return NixlView(int(share.num_pages), remote, share.nixl_mem_type, share.nixl_device_id, layers)


def read_descs(pool: KVPool, view: NixlView, layers: Sequence[int], src_ids: Sequence[int],
               dst_ids: Sequence[int], device_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(local, remote) descriptor rows (address, bytes, device id) of pages ``src_ids`` of ``view``'s ``layers``
    into ``dst_ids`` of ``pool``'s: one row per layer, part and run of consecutive pages, in numpy over all
    layers at once. Ids must be checked against both pools by the caller."""
    runs = np.asarray(page_runs(src_ids, dst_ids), dtype=np.int64).reshape(-1, 3)  # page_runs: numpy over the ids
    s0, d0, m = runs[:, 0], runs[:, 1], runs[:, 2]
    local, remote = [], []
    for part in PARTS:
        tensors = [getattr(pool.layers[i], part) for i in layers]
        if tensors[0] is None:
            continue
        rts = [view.layers[i][part] for i in layers]
        pb = np.array([r.page_bytes for r in rts], dtype=np.int64)[:, None]  # [layers, 1]
        lbase = np.array([t.data_ptr() for t in tensors], dtype=np.int64)[:, None]
        rbase = np.array([r.address for r in rts], dtype=np.int64)[:, None]
        n = (m[None, :] * pb).reshape(-1)
        local.append(np.stack([(lbase + d0[None, :] * pb).reshape(-1), n, np.full_like(n, device_id)], axis=1))
        remote.append(np.stack([(rbase + s0[None, :] * pb).reshape(-1), n, np.full_like(n, view.device_id)], axis=1))
    return np.concatenate(local).astype(np.uint64), np.concatenate(remote).astype(np.uint64)
