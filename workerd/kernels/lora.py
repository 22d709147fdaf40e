"""Batched multi-LoRA on CPU ranks (workerd/kernels/cpu_lora.c, issue 46).

For one linear layer in one step, every request's adapter adds
B @ (A @ x[t]) to its rows of the layer's output, in place:

    for each segment (row_start, row_end, a), each part p of adapter a:
        y[t, col_off : col_off + n_out] += B @ (A @ x[t])   for t in the rows

A layer whose output is several projections side by side (qkv, gate_up)
has one part per projection, each with its columns of y. The LoRA scale
(alpha / r) is the caller's to fold into B (or A): the kernel adds the bare
product. The C code groups the rows by adapter, so each adapter's A and B
are read once per block of its rows rather than gathered per token
(vLLM's CPU path). Sums are float32; in bfloat16, A @ x is rounded to bf16
before B multiplies it (as a bf16 lora_A's output is in PEFT) and y once,
at the end. Results do not depend on torch's thread count.

`segments` is int64 [S, 3] (row_start, row_end, adapter index into the
table's first dimension); rows in no segment are left exactly as they were.
`table` is int64 [num_adapters, num_parts, 5] of (A pointer, B pointer,
rank, col_off, n_out), an A pointer of 0 marking an absent part; build it
with lora_table, which checks every A and B it points at, and keep those
tensors alive (and unchanged in place, shape and storage) for as long as
the table is used: the table holds their raw addresses, and lora_add cannot
tell a freed or reshaped tensor from a live one. The kernel checks every
index and column range before it reads or writes anything.

lora_add returns False, having done nothing, for tensors the C code does not
read (the caller runs its torch code), True once y holds the sum; a bad
segment or table raises ValueError with y untouched.
"""

from __future__ import annotations

import torch

from workerd.kernels.loader import CpuKernels, KernelUnavailable, load_kernels

# The largest rank the kernel takes (cpu_lora.c's MAX_RANK).
MAX_RANK = 512
TABLE_FIELDS = 5
_DTYPES = (torch.float32, torch.bfloat16)
# cpu_lora.c's error codes.
_ERRORS = {
    1: "sizes or strides the kernel does not take",
    2: "a segment's rows fall outside the batch (or start after they end)",
    3: "a segment's adapter index is outside the table",
    4: f"a present part's rank is outside [1, {MAX_RANK}]",
    5: "a present part's columns (col_off + n_out) fall outside y",
    6: "a present part with output columns has no B",
    7: "out of memory",
}

# A part of one adapter: (A [rank, n_in], B [n_out, rank], col_off), or None.
LoraPart = tuple[torch.Tensor, torch.Tensor, int] | None


def lora_kernels() -> CpuKernels | None:
    """The loaded C kernels (the library every CPU kernel shares, built at
    first use), or None where they cannot be built here (the caller runs its
    torch code). Ranks that bind custom ops get theirs from
    workerd/layers/custom_op.rank_kernels; this is the same cached library."""
    try:
        return load_kernels()
    except KernelUnavailable:
        return None


def lora_table(parts_per_adapter: list[list[LoraPart]], n_in: int, n_y: int,
               dtype: torch.dtype) -> torch.Tensor:
    """The kernel's table, int64 [num_adapters, num_parts, 5], from each
    adapter's parts (every adapter lists the same number; None: absent).

    Checks what the kernel cannot: each A is [rank, n_in] and each B
    [n_out, rank], both contiguous CPU tensors of `dtype`, 1 <= rank <=
    MAX_RANK, n_out >= 1 and 0 <= col_off with col_off + n_out <= n_y;
    ValueError otherwise. The table holds the tensors' addresses: the caller
    keeps every A and B alive and unmodified in shape and storage for as long
    as it uses the table."""
    if dtype not in _DTYPES:
        raise ValueError(f"lora_table: dtype {dtype} (float32 or bfloat16 only)")
    if n_in < 1 or n_y < 0:
        raise ValueError(f"lora_table: n_in {n_in}, n_y {n_y}")
    num_parts = len(parts_per_adapter[0]) if parts_per_adapter else 0
    table = torch.zeros(len(parts_per_adapter), num_parts, TABLE_FIELDS, dtype=torch.int64)
    for a, parts in enumerate(parts_per_adapter):
        if len(parts) != num_parts:
            raise ValueError(f"lora_table: adapter {a} has {len(parts)} parts, "
                             f"adapter 0 has {num_parts}")
        for p, part in enumerate(parts):
            if part is None:
                continue
            A, B, col_off = part
            where = f"lora_table: adapter {a} part {p}"
            for name, t in (("A", A), ("B", B)):
                if not (isinstance(t, torch.Tensor) and t.dim() == 2 and t.dtype == dtype
                        and t.device.type == "cpu" and t.is_contiguous()):
                    raise ValueError(f"{where}: {name} must be a 2-D contiguous CPU {dtype} "
                                     f"tensor")
            rank, n_out = A.shape[0], B.shape[0]
            if A.shape[1] != n_in:
                raise ValueError(f"{where}: A is {tuple(A.shape)}, not [rank, {n_in}]")
            if not 1 <= rank <= MAX_RANK:
                raise ValueError(f"{where}: rank {rank} outside [1, {MAX_RANK}]")
            if B.shape[1] != rank:
                raise ValueError(f"{where}: B is {tuple(B.shape)}, not [n_out, {rank}]")
            col_off = int(col_off)
            if n_out < 1 or col_off < 0 or col_off + n_out > n_y:
                raise ValueError(f"{where}: columns {col_off}..{col_off + n_out} "
                                 f"outside y's {n_y}")
            table[a, p] = torch.tensor([A.data_ptr(), B.data_ptr(), rank, col_off, n_out])
    return table


def _rows(t: torch.Tensor) -> bool:
    """A 2-D CPU float32 / bf16 tensor of rows the kernel reads: contiguous
    features, rows at least a row apart (no row overlaps another)."""
    return (isinstance(t, torch.Tensor) and t.dim() == 2 and t.dtype in _DTYPES
            and t.device.type == "cpu" and t.shape[1] >= 1
            and (t.stride(1) == 1 or t.shape[1] == 1)
            and (t.stride(0) >= t.shape[1] or t.shape[0] <= 1))


def _int64_table(t: torch.Tensor, dims: int, last: int) -> bool:
    return (isinstance(t, torch.Tensor) and t.dtype == torch.int64 and t.device.type == "cpu"
            and t.dim() == dims and t.shape[-1] == last and t.is_contiguous())


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes [first, last) t's elements lie in."""
    first = t.data_ptr()
    last = first + t.element_size() * (1 + sum((n - 1) * s for n, s in zip(
        t.shape, t.stride(), strict=True)))
    return first, last


def lora_add(kernels: CpuKernels | None, x: torch.Tensor, y: torch.Tensor,
             segments: torch.Tensor, table: torch.Tensor) -> bool:
    """y[rows of each segment, a part's columns] += B @ (A @ x[row]) for the
    segment's adapter (module docstring), in place, with torch's threads.

    x [n_rows, n_in] and y [n_rows, n_y]: CPU float32 or bfloat16, one dtype,
    features contiguous, y not overlapping x; segments int64 [S, 3] and
    table int64 [num_adapters, num_parts, 5] (lora_table's, built for x's
    n_in and dtype and y's width), both contiguous. False (nothing done) when
    the tensors are not these, or autograd would need the product; True when
    done. ValueError, y untouched, for a segment outside the rows or the
    table, or a table entry whose rank or columns do not fit y."""
    if not (kernels is not None and _rows(x) and _rows(y) and x.dtype == y.dtype
            and x.shape[0] == y.shape[0] and _int64_table(segments, 2, 3)
            and _int64_table(table, 3, TABLE_FIELDS)):
        return False
    if torch.is_grad_enabled() and (x.requires_grad or y.requires_grad):
        return False
    n_rows, n_in = x.shape
    n_y = y.shape[1]
    if n_rows and segments.shape[0]:
        (x0, x1), (y0, y1) = _span(x), _span(y)
        if x0 < y1 and y0 < x1:
            return False  # y written while x is read
    kernel = kernels.lora_add if x.dtype == torch.float32 else kernels.lora_add_bf16
    # A row stride as the kernel reads it (>= the width; any for a single row).
    x_stride = max(x.stride(0), n_in)
    y_stride = max(y.stride(0), n_y)
    rc = kernel(x.data_ptr(), x_stride, n_rows, n_in, y.data_ptr(), y_stride, n_y,
                segments.data_ptr(), segments.shape[0], table.data_ptr(), table.shape[0],
                table.shape[1], torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"lora_add refused the call: {_ERRORS.get(rc, rc)}")
    return True


class BoundLoRACall:
    """lora_add for one layer and one checked table, with what does not
    change from step to step worked out once: the kernel, the table's
    pointer and sizes, the widths of x and y. A decode step calls every
    layer's kernel; lora_add's general checks (any layout, any overlap) cost
    more than the kernel at a few rows, so the common layout, contiguous x
    and y of the table's widths, not overlapping, is checked here with a
    few comparisons and anything else is left to lora_add. The table must
    stay alive and unchanged while this is used (the caller holds both)."""

    def __init__(self, kernels: CpuKernels, table: torch.Tensor, n_in: int, n_y: int,
                 dtype: torch.dtype):
        if dtype not in _DTYPES or not _int64_table(table, 3, TABLE_FIELDS):
            raise ValueError(f"no kernel call for dtype {dtype} or this table")
        self.kernels = kernels
        self.table = table
        self.fn = kernels.lora_add if dtype == torch.float32 else kernels.lora_add_bf16
        self.table_ptr = table.data_ptr()
        self.num_adapters, self.num_parts = table.shape[0], table.shape[1]
        self.n_in, self.n_y, self.dtype = n_in, n_y, dtype
        self.itemsize = torch.empty(0, dtype=dtype).element_size()

    def __call__(self, x: torch.Tensor, y: torch.Tensor, segments: torch.Tensor,
                 threads: int) -> bool:
        """False (nothing done) for anything but the common layout: then
        the caller goes through lora_add. segments: LoRAStep's, checked when
        the step was set (the kernel checks its rows and adapters again)."""
        n_in, n_y = self.n_in, self.n_y
        if (x.dtype != self.dtype or y.dtype != self.dtype or x.dim() != 2 or y.dim() != 2
                or x.shape[1] != n_in or y.shape[1] != n_y or x.shape[0] != y.shape[0]
                or not x.is_contiguous() or not y.is_contiguous()
                or x.device.type != "cpu" or y.device.type != "cpu"
                or not _int64_table(segments, 2, 3)):
            return lora_add(self.kernels, x, y, segments, self.table)
        n = x.shape[0]
        xp, yp = x.data_ptr(), y.data_ptr()
        if xp < yp + n * n_y * self.itemsize and yp < xp + n * n_in * self.itemsize:
            return False  # y written while x is read
        rc = self.fn(xp, n_in, n, n_in, yp, n_y, n_y, segments.data_ptr(), segments.shape[0],
                     self.table_ptr, self.num_adapters, self.num_parts, threads)
        if rc != 0:
            raise ValueError(f"lora_add refused the call: {_ERRORS.get(rc, rc)}")
        return True
