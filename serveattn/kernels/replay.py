"""A prefill plan's repeated launch: its first plain launch (no scales or descales, straight from
attention.launch) made once, and repeated while nothing it followed from has moved.

A server calls run() with the same plan, cache and argument layout at every layer of a step. What attention.launch
decides for a call (the gather check, which kernel serves it, the TMA row maps and descriptors, Pack's key of 30-60
arguments) follows from the plan and from what a Replay checks: the same K/V (paged: the same objects at the same
address, shape and strides, held weakly; ragged: the same dtype, shape and strides, 16-byte aligned), q / out / lse
of the same dtype, shape and strides, 16-byte aligned, the same grid and gather_ok, and the same switches. Then the
arguments differ from the first call's only in the tensors (and descriptors) at the front, with the same key parts,
and the launch goes to the same compiled entry (Pack.launch_keyed: the device, debug mode and rebound globals are
still checked there). Anything else: False, and the call takes the full path (which makes a new Replay only at a
plan's first plain call: the plan's memo keeps the first).

CPU: prefill run() through the fast launch 22 -> 9.5 us (ragged), 18 -> 9.5 us (paged); H200 host: 65-78 -> 29-32
us (docs/performance.md, session 19).
"""
from __future__ import annotations

import weakref

import torch

from .. import knobs

KEY = "replay"  # plan.launch_memo's key of its Replay

# the switches a plain launch's decisions read (attention._launch_gathered, attention_ws.serves, _q_descriptor,
# attention_ws.launch)
SWITCHES = ("SERVEATTN_PREFILL_WS", "TRITON_INTERPRET", "SERVEATTN_PREFILL_WS_QTMA", "SERVEATTN_PREFILL_WS_PERSISTENT",
            "SERVEATTN_PREFILL_GATHER", "SERVEATTN_PREFILL_WS_FP8")


class _HashedParts(tuple):
    """A key's positional parts with their hash made once (a descriptor's part holds a Gluon layout, whose hash
    costs about a microsecond)."""

    def __hash__(self):
        h = self.__dict__.get("hash")
        if h is None:
            h = self.__dict__["hash"] = tuple.__hash__(self)
        return h


def aligned(*tensors) -> bool:
    """Every tensor given (None skipped) starts on a 16-byte boundary."""
    return not any(t is not None and t.data_ptr() & 15 for t in tensors)


class Replay:
    """args: the first call's positional arguments, which start with q, then K and V (`descriptor` None) or the
    first TMA operand and K's and V's descriptors (`descriptor`: the TensorDescriptor class), then out and lse's
    argument; every later argument is the plan's or follows from the strides checked here.
    fp8 attention (`descales` given; the warp-specialized kernel only): the call's V^T is made anew by the plan's
    transpose launch (`transpose`: its Pack, key, arguments (V, V^T, then the plan's) and grid), V's descriptor is
    V^T's, and the arguments end with (column indptr, scale_q, scale_k, scale_v, two per-head flags): the call's
    descales take their places (their shapes, hence the flags, as the first call's; 16-byte aligned)."""

    def __init__(self, pack, arg_key, args, grid, q, k, v, out, lse, grid0: int, gather_ok: bool, ragged: bool,
                 descriptor=None, descales=None, transpose=None, scales_at=None, scale_kinds=None):
        self.pack, self.grid, self.descriptor = pack, grid, descriptor
        self.arg_key = (arg_key[0], _HashedParts(arg_key[1]))
        front = 6 if descriptor is not None else 5
        self.rest = args[front:]
        # scales_at: where (qk_scale, v_scale, k_scale_ptr, v_scale_ptr) stand among args; the call passes its own
        # (its scale tensors, if any, as the first call's: scale_kinds, aligned)
        self.scales_at = None if scales_at is None else scales_at - front
        self.scale_kinds = scale_kinds
        self.descales = None if descales is None else tuple((d.dtype, d.shape) for d in descales)
        if descales is not None:
            t_pack, t_key, t_args, t_grid = transpose
            vt = t_args[1]
            self.transpose = (t_pack, (t_key[0], _HashedParts(t_key[1])), t_args[2:], t_grid, vt.shape, vt.dtype)
        if descriptor is not None:
            # descriptor fields but the base (the same shape, strides, block, layout and padding at every call)
            self.q_fields = dict(args[1].__dict__, base=None) if args[1] is not args[2] else None
            self.kv_fields = (dict(args[2].__dict__, base=None), dict(args[3].__dict__, base=None))
            kv_objects = (args[2], args[3])
        else:
            kv_objects = (k, v)
        self.layouts = (q.dtype, q.shape, q.stride(), out.dtype, out.shape, out.stride(),
                        None if lse is None else (lse.shape, lse.stride()), grid0, gather_ok,
                        k.dtype, k.shape, k.stride(), v.dtype, v.shape, v.stride())
        self.switches = knobs.snapshot(SWITCHES)
        # paged: the cache views (prefill._cache_views) and their descriptors (attention_ws._kept_descriptor) are the
        # same objects at every step; held weakly (a plan must not keep a dropped cache alive)
        self.ragged = ragged
        # (fp8: V's operand is the call's own V^T descriptor, made in __call__)
        self.kv_held = None if ragged else (weakref.ref(k), weakref.ref(v), k.data_ptr(), v.data_ptr(),
                                            weakref.ref(kv_objects[0]),
                                            weakref.ref(kv_objects[1]) if descales is None else None)

    def __call__(self, q, k, v, out, lse, grid0: int, gather_ok: bool, descales=None, scales=None) -> bool:
        """Launches as the first call did, with this call's tensors; False (nothing launched) where it may not."""
        ready = self.prepare(q, k, v, out, lse, grid0, gather_ok, descales, scales)
        if ready is None:
            return False
        self.launch(ready)
        return True

    def launch(self, ready):
        """Launches what prepare() made: fp8's V^T first, then the kernel."""
        args, transpose = ready
        if transpose is not None:
            t_pack, t_key, t_rest, t_grid = self.transpose[:4]
            t_pack.launch_keyed(t_grid, transpose + t_rest, t_key)
        self.pack.launch_keyed(self.grid, args, self.arg_key)

    def prepare(self, q, k, v, out, lse, grid0: int, gather_ok: bool, descales=None, scales=None):
        """The launch's arguments for this call's tensors (and fp8's (V, V^T) for the transpose), or None where it
        may not repeat the first call. scales: (qk_scale, v_scale, k_scale_ptr, v_scale_ptr, k on device, v on
        device) of this call (kept at `scales_at`; attention._launch_gathered's)."""
        if q.__class__ is not torch.Tensor or out.__class__ is not torch.Tensor or lse is not None and \
                lse.__class__ is not torch.Tensor:
            return None
        if (descales is None) != (self.descales is None) or (scales is None) != (self.scale_kinds is None):
            return None
        if descales is not None:
            if any(d.__class__ is not torch.Tensor for d in descales) or not aligned(*descales) or \
                    tuple((d.dtype, d.shape) for d in descales) != self.descales:
                return None
        if scales is not None and (scales[4:] != self.scale_kinds or
                                   not aligned(*(t for t, dev in zip(scales[2:4], scales[4:]) if dev))):
            return None
        if (q.dtype, q.shape, q.stride(), out.dtype, out.shape, out.stride(),
                None if lse is None else (lse.shape, lse.stride()), grid0, gather_ok,
                k.dtype, k.shape, k.stride(), v.dtype, v.shape, v.stride()) != self.layouts:
            return None
        if not aligned(q, out, lse) or knobs.snapshot(SWITCHES) != self.switches:
            return None
        if self.ragged:  # new K/V every step
            if not aligned(k, v):
                return None
            if self.descriptor is not None:
                k_fields, v_fields = self.kv_fields
                k_op, v_op = object.__new__(self.descriptor), object.__new__(self.descriptor)
                k_op.__dict__.update(k_fields, base=k)
                v_op.__dict__.update(v_fields, base=v)
            else:
                k_op, v_op = k, v
        else:
            k_ref, v_ref, k_ptr, v_ptr, k_op_ref, v_op_ref = self.kv_held
            if k_ref() is not k or v_ref() is not v or k.data_ptr() != k_ptr or v.data_ptr() != v_ptr:
                return None
            k_op, v_op = k_op_ref(), v_op_ref() if v_op_ref is not None else v
            if k_op is None or v_op is None:
                return None
        rest, transpose = self.rest, None
        if scales is not None:
            at = self.scales_at
            rest = rest[:at] + scales[:4] + rest[at + 4:]
        if descales is not None:  # this call's V^T, then its descriptor and the call's descales
            vt = torch.empty(self.transpose[4], dtype=self.transpose[5], device=v.device)
            transpose = (v, vt)
            v_op = object.__new__(self.descriptor)
            v_op.__dict__.update(self.kv_fields[1], base=vt)
            rest = rest[:-5] + tuple(descales) + rest[-2:]
        lse_arg = lse if lse is not None else out
        if self.descriptor is None:
            front = (q, k_op, v_op, out, lse_arg)
        elif self.q_fields is not None:  # q by TMA
            q_op = object.__new__(self.descriptor)
            q_op.__dict__.update(self.q_fields, base=q)
            front = (q, q_op, k_op, v_op, out, lse_arg)
        else:
            front = (q, k_op, k_op, v_op, out, lse_arg)
        return front + rest, transpose


GATHERED = "gathered"  # a paged plan's launch memo key of its Gathered


class Gathered:
    """A paged plan's call through attention._launch_gathered repeated: its pages copied into new ragged rows of q's
    dtype (the plan's gather Pack and key; the same cache objects at the same address as the first call's), then
    the ragged plan's Replay of the warp-specialized launch over those rows, with this call's k_scale/v_scale
    (kv_scale_args: floats or device tensors, as the first call's). None of it launches where the Replay may not
    (which also watches the switches: made in the same call, it holds the same snapshot)."""

    def __init__(self, gather, inner: Replay, k, v, rows_shape, rows_dtype):
        g_pack, g_args, g_grid = gather
        self.g_pack, self.g_grid, self.g_rest = g_pack, g_grid, g_args[4:]
        g_key = g_pack.arguments_key(g_args)
        self.g_key = None if g_key is None else (g_key[0], _HashedParts(g_key[1]))
        self.inner = inner
        self.rows = (rows_shape, rows_dtype)
        self.held = (weakref.ref(k), weakref.ref(v), k.data_ptr(), v.data_ptr(), k.shape, k.stride(), v.stride())

    def __call__(self, q, k, v, out, lse, grid0: int, scales) -> bool:
        k_ref, v_ref, k_ptr, v_ptr, shape, k_strides, v_strides = self.held
        if (self.g_key is None or k_ref() is not k or v_ref() is not v or k.data_ptr() != k_ptr
                or v.data_ptr() != v_ptr or k.shape != shape or k.stride() != k_strides or v.stride() != v_strides
                or q.dtype != self.rows[1]):
            return False
        ko = torch.empty(self.rows[0], dtype=self.rows[1], device=q.device)
        vo = torch.empty(self.rows[0], dtype=self.rows[1], device=q.device)
        ready = self.inner.prepare(q, ko, vo, out, lse, grid0, False, scales=scales)
        if ready is None:
            return False
        self.g_pack.launch_keyed(self.g_grid, (k, v, ko, vo) + self.g_rest, self.g_key)
        self.inner.launch(ready)
        return True
