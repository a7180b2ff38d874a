"""What the pinned ggml-metal declares: a port of `ggml_metal_device_supports_op` (and the
`ggml_metal_supports_mul_mat_op` it calls) from ggml 0.25.3's `src/ggml-metal/ggml-metal-device.m`,
for the ops and types a toyharness graph can hold. Nobody here runs Metal: this is how
Program.lowering_target "metal" and tests/test_metal_lowering.py know which nodes a Mac would refuse.

The device is taken to be an Apple GPU of family Apple7 or later (M1 and after): simdgroup
reductions and simdgroup matrix products, and no bfloat (the conservative answer: M1 lacks it).
An op the port does not cover answers False with "not ported", never a guess.

METAL_SUPPORTS_OP_SHA256 is the sha256 of the two functions' text in the pinned source: a ggml
upgrade that changes them fails tests/test_metal_lowering.py until the port is read again.
"""

from __future__ import annotations

from .._ffi import ffi, lib

METAL_SOURCE = "src/ggml-metal/ggml-metal-device.m"
METAL_FUNCTIONS = ("static bool ggml_metal_supports_mul_mat_op(", "bool ggml_metal_device_supports_op(")
METAL_SUPPORTS_OP_SHA256 = "88357643d87b9e433d4fd4d94101075f787d80358e9b4a703e67f3b07f9bc8be"

HAS_SIMDGROUP_REDUCTION = True
HAS_SIMDGROUP_MM = True
HAS_BFLOAT = False

# ggml 0.25.3's enum values (include/ggml.h)
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 0, 1, 2, 3, 6, 7, 8
IQ4_NL, I8, I16, I32, I64, BF16, TQ1_0, TQ2_0, NVFP4, Q1_0, Q2_0 = 20, 24, 25, 26, 27, 30, 34, 35, 40, 41, 42
UNARY_OPS = ("ABS", "SGN", "NEG", "STEP", "TANH", "ELU", "RELU", "SIGMOID", "GELU", "GELU_QUICK", "SILU",
             "HARDSWISH", "HARDSIGMOID", "EXP", "EXPM1", "SOFTPLUS", "GELU_ERF", "XIELU", "FLOOR", "CEIL",
             "ROUND", "TRUNC")
METAL_UNARY = {"TANH", "RELU", "SIGMOID", "GELU", "GELU_ERF", "GELU_QUICK", "SILU", "ELU", "NEG", "ABS", "SGN",
               "STEP", "HARDSWISH", "HARDSIGMOID", "EXP", "SOFTPLUS", "EXPM1", "FLOOR", "CEIL", "ROUND", "TRUNC",
               "XIELU"}
GLU_OPS = ("REGLU", "GEGLU", "SWIGLU", "SWIGLU_OAI", "GEGLU_ERF", "GEGLU_QUICK", "SWIGLU_CLAMP")


def _src(t, i: int):
    s = lib.th_tensor_src(t, i)
    return None if s == ffi.NULL else s


def _type(t) -> int:
    return int(lib.th_tensor_type(t))


def _ne(t) -> list[int]:
    ne = ffi.new("int64_t[4]")
    lib.th_tensor_shape(t, ne, ffi.new("size_t[4]"))
    return list(ne)


def _rows(t) -> bool:
    return bool(lib.ggml_is_contiguous_rows(t))


def _f32_or_f16(t) -> bool:
    return _type(t) in (F32, F16)


def metal_refusal(op) -> str | None:
    """None where the pinned ggml-metal declares `op` (a ggml_tensor *), else why not."""
    name = ffi.string(lib.ggml_op_desc(op)).decode()
    s0, s1, s2 = _src(op, 0), _src(op, 1), _src(op, 2)
    if not HAS_BFLOAT and (_type(op) == BF16 or any(s is not None and _type(s) == BF16 for s in (s0, s1, s2))):
        return "bf16 on a device without bfloat"
    kind = name
    if name in UNARY_OPS:
        kind = "UNARY"
    elif name in GLU_OPS:
        kind = "GLU"
    ok: bool
    if kind in ("SCALE", "FILL", "CLAMP", "SQR", "SQRT", "SIN", "COS", "LOG"):
        ok = _rows(s0) and _f32_or_f16(s0)
    elif kind == "UNARY":
        ok = name in METAL_UNARY and _rows(s0) and _f32_or_f16(s0)
    elif kind == "SILU_BACK":
        ok = (_type(s0) == F32 and _type(s1) == F32 and _type(op) == F32 and bool(lib.ggml_is_contiguous(s0))
              and bool(lib.ggml_is_contiguous(s1)) and bool(lib.ggml_is_contiguous(op))
              and bool(lib.ggml_are_same_shape(s0, s1)))
    elif kind == "GLU":
        ok = bool(lib.ggml_is_contiguous_1(s0)) and _f32_or_f16(s0)
    elif kind in ("NONE", "RESHAPE", "VIEW", "TRANSPOSE", "PERMUTE", "REPEAT", "ROPE", "ROPE_BACK", "DIAG"):
        ok = True
    elif kind == "CONCAT":
        ok = _type(s0) == _type(s1) == _type(op) and _type(s0) in (F32, F16, I8, I16, I32, I64, Q4_0, Q4_1,
                                                                   Q5_0, Q5_1, Q8_0)
    elif kind in ("ADD", "SUB", "MUL", "DIV"):
        ok = _rows(s0) and _rows(s1) and _f32_or_f16(s0) and _type(s0) == _type(s1)
    elif kind == "ACC":
        ok = _rows(s0) and _rows(s1) and _type(s0) == F32
    elif kind == "SUM":
        ok = HAS_SIMDGROUP_REDUCTION and bool(lib.ggml_is_contiguous(s0))
    elif kind in ("SUM_ROWS", "MEAN", "SOFT_MAX", "NORM", "RMS_NORM"):
        ok = HAS_SIMDGROUP_REDUCTION and _rows(s0)
    elif kind == "IM2COL":
        ok = bool(lib.ggml_is_contiguous(s1)) and _type(s1) == F32 and _type(op) in (F16, F32)
    elif kind == "POOL_2D":
        ok = _type(s0) == F32
    elif kind == "MUL_MAT":
        # ggml_metal_supports_mul_mat_op: any src1 but F16 (whose paths the port does not cover)
        if _type(s1) == F16:
            return "MUL_MAT with an f16 src1: not ported"
        ok = HAS_SIMDGROUP_REDUCTION and _type(s0) not in (NVFP4, TQ1_0)
    elif kind in ("SET", "CPY", "DUP", "CONT"):
        t0, t = _type(s0), _type(op)
        if t0 == F32:
            ok = t in (F32, F16, BF16, Q8_0, Q1_0, Q2_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, TQ2_0, I32)
        elif t0 == F16:
            ok = t in (F32, F16)
        elif t0 == BF16:
            ok = t in (F32, BF16)
        elif t0 in (Q1_0, Q2_0, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, TQ2_0):
            ok = t in (F32, F16)
        elif t0 == I32:
            ok = t in (F32, I32)
        else:
            ok = False
    elif kind == "GET_ROWS":
        ok = _type(s0) not in (NVFP4, TQ1_0)
    elif kind == "SET_ROWS":
        t0, t = _type(s0), _type(op)
        if t0 == F16:
            ok = t == F16
        else:
            ok = t0 == F32 and t in (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, TQ2_0)
    elif kind == "OPT_STEP_ADAMW":
        ok = HAS_SIMDGROUP_REDUCTION
    elif kind in ("OUT_PROD", "CROSS_ENTROPY_LOSS", "CROSS_ENTROPY_LOSS_BACK", "SOFT_MAX_BACK", "RMS_NORM_BACK",
                  "GET_ROWS_BACK", "REPEAT_BACK", "DIAG_MASK_INF", "DIAG_MASK_ZERO", "CUSTOM", "IM2COL_BACK",
                  "POOL_2D_BACK", "SCALE_BACK"):
        return f"{name}: no case in ggml_metal_device_supports_op (its default: false)"
    else:
        return f"{name}: not ported (tensor ops toyharness graphs do not hold)"
    return None if ok else f"{name}: declared for other types or layouts only"


def metal_supports_op(op) -> bool:
    return metal_refusal(op) is None
