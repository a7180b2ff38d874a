"""cffi binding (ABI mode) to the pinned ggml and our shim.

Only the functions the engine calls are declared, by their documented prototypes; ggml's
structs stay opaque (the shim reads shapes and data pointers). The libraries are the ones the
package build copied into ``toyharness/_native`` (``TOYHARNESS_NATIVE_DIR`` overrides that, for
example to use a cuda build made on another machine).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
from pathlib import Path

from cffi import FFI

from .switches import switch

CDEF = r"""
typedef struct ggml_context ggml_context;
typedef struct ggml_tensor ggml_tensor;
typedef struct ggml_cgraph ggml_cgraph;
typedef struct ggml_backend * ggml_backend_t;
typedef struct ggml_backend_buffer * ggml_backend_buffer_t;
typedef struct ggml_backend_buffer_type * ggml_backend_buffer_type_t;
typedef struct ggml_backend_device * ggml_backend_dev_t;
typedef struct ggml_gallocr * ggml_gallocr_t;

struct ggml_init_params { size_t mem_size; void * mem_buffer; bool no_alloc; };

size_t ggml_tensor_overhead(void);
size_t ggml_graph_overhead_custom(size_t size, bool grads);
size_t ggml_used_mem(const ggml_context * ctx);
size_t ggml_get_mem_size(const ggml_context * ctx);
ggml_context * ggml_init(struct ggml_init_params params);
void ggml_free(ggml_context * ctx);
int64_t ggml_nelements(const ggml_tensor * t);
size_t ggml_nbytes(const ggml_tensor * t);
size_t ggml_type_size(int type);
int64_t ggml_blck_size(int type);
bool ggml_quantize_requires_imatrix(int type);
size_t ggml_quantize_chunk(int type, const float * src, void * dst, int64_t start, int64_t nrows, int64_t n_per_row,
                           const float * imatrix);
bool ggml_is_contiguous(const ggml_tensor * t);
bool ggml_is_contiguous_1(const ggml_tensor * t);
bool ggml_is_contiguous_rows(const ggml_tensor * t);
bool ggml_is_transposed(const ggml_tensor * t);
bool ggml_are_same_shape(const ggml_tensor * t0, const ggml_tensor * t1);
bool ggml_can_repeat(const ggml_tensor * t0, const ggml_tensor * t1);

ggml_tensor * ggml_new_tensor_1d(ggml_context * ctx, int type, int64_t ne0);
ggml_tensor * ggml_new_tensor_2d(ggml_context * ctx, int type, int64_t ne0, int64_t ne1);
ggml_tensor * ggml_new_tensor_3d(ggml_context * ctx, int type, int64_t ne0, int64_t ne1, int64_t ne2);
ggml_tensor * ggml_new_tensor_4d(ggml_context * ctx, int type, int64_t ne0, int64_t ne1, int64_t ne2, int64_t ne3);
ggml_tensor * ggml_set_name(ggml_tensor * t, const char * name);
const char * ggml_get_name(const ggml_tensor * t);
void ggml_set_input(ggml_tensor * t);
void ggml_set_output(ggml_tensor * t);
void ggml_set_param(ggml_tensor * t);
void ggml_set_loss(ggml_tensor * t);

ggml_tensor * ggml_add(ggml_context * ctx, ggml_tensor * a, ggml_tensor * b);
ggml_tensor * ggml_sub(ggml_context * ctx, ggml_tensor * a, ggml_tensor * b);
ggml_tensor * ggml_mul(ggml_context * ctx, ggml_tensor * a, ggml_tensor * b);
ggml_tensor * ggml_div(ggml_context * ctx, ggml_tensor * a, ggml_tensor * b);
ggml_tensor * ggml_sqr(ggml_context * ctx, ggml_tensor * a);
ggml_tensor * ggml_sqrt(ggml_context * ctx, ggml_tensor * a);
ggml_tensor * ggml_log(ggml_context * ctx, ggml_tensor * a);
ggml_tensor * ggml_exp(ggml_context * ctx, ggml_tensor * a);
ggml_tensor * ggml_neg(ggml_context * ctx, ggml_tensor * a);
ggml_tensor * ggml_relu(ggml_context * ctx, ggml_tensor * a);
ggml_tensor * ggml_silu(ggml_context * ctx, ggml_tensor * a);
ggml_tensor * ggml_softplus(ggml_context * ctx, ggml_tensor * a);
ggml_tensor * ggml_abs(ggml_context * ctx, ggml_tensor * a);
ggml_tensor * ggml_sgn(ggml_context * ctx, ggml_tensor * a);
ggml_tensor * ggml_step(ggml_context * ctx, ggml_tensor * a);
ggml_tensor * ggml_acc(ggml_context * ctx, ggml_tensor * a, ggml_tensor * b, size_t nb1, size_t nb2, size_t nb3,
                       size_t offset);
ggml_tensor * ggml_view_4d(ggml_context * ctx, ggml_tensor * a, int64_t ne0, int64_t ne1, int64_t ne2, int64_t ne3,
                           size_t nb1, size_t nb2, size_t nb3, size_t offset);
ggml_tensor * ggml_sum(ggml_context * ctx, ggml_tensor * a);
ggml_tensor * ggml_sum_rows(ggml_context * ctx, ggml_tensor * a);
ggml_tensor * ggml_repeat(ggml_context * ctx, ggml_tensor * a, ggml_tensor * b);
ggml_tensor * ggml_repeat_4d(ggml_context * ctx, ggml_tensor * a, int64_t ne0, int64_t ne1, int64_t ne2, int64_t ne3);
ggml_tensor * ggml_scale(ggml_context * ctx, ggml_tensor * a, float s);
ggml_tensor * ggml_scale_bias(ggml_context * ctx, ggml_tensor * a, float s, float b);
ggml_tensor * ggml_rms_norm(ggml_context * ctx, ggml_tensor * a, float eps);
ggml_tensor * ggml_mul_mat(ggml_context * ctx, ggml_tensor * a, ggml_tensor * b);
ggml_tensor * ggml_cont(ggml_context * ctx, ggml_tensor * a);
ggml_tensor * ggml_cpy(ggml_context * ctx, ggml_tensor * a, ggml_tensor * b);
ggml_tensor * ggml_reshape_1d(ggml_context * ctx, ggml_tensor * a, int64_t ne0);
ggml_tensor * ggml_reshape_2d(ggml_context * ctx, ggml_tensor * a, int64_t ne0, int64_t ne1);
ggml_tensor * ggml_reshape_3d(ggml_context * ctx, ggml_tensor * a, int64_t ne0, int64_t ne1, int64_t ne2);
ggml_tensor * ggml_reshape_4d(ggml_context * ctx, ggml_tensor * a, int64_t ne0, int64_t ne1, int64_t ne2, int64_t ne3);
ggml_tensor * ggml_view_1d(ggml_context * ctx, ggml_tensor * a, int64_t ne0, size_t offset);
ggml_tensor * ggml_view_2d(ggml_context * ctx, ggml_tensor * a, int64_t ne0, int64_t ne1, size_t nb1, size_t offset);
ggml_tensor * ggml_view_3d(ggml_context * ctx, ggml_tensor * a, int64_t ne0, int64_t ne1, int64_t ne2,
                           size_t nb1, size_t nb2, size_t offset);
ggml_tensor * ggml_permute(ggml_context * ctx, ggml_tensor * a, int axis0, int axis1, int axis2, int axis3);
ggml_tensor * ggml_transpose(ggml_context * ctx, ggml_tensor * a);
ggml_tensor * ggml_out_prod(ggml_context * ctx, ggml_tensor * a, ggml_tensor * b);
ggml_tensor * ggml_cont_4d(ggml_context * ctx, ggml_tensor * a, int64_t ne0, int64_t ne1, int64_t ne2, int64_t ne3);
ggml_tensor * ggml_get_rows(ggml_context * ctx, ggml_tensor * a, ggml_tensor * b);
ggml_tensor * ggml_set_rows(ggml_context * ctx, ggml_tensor * a, ggml_tensor * b, ggml_tensor * c);
ggml_tensor * ggml_fill(ggml_context * ctx, ggml_tensor * a, float c);
ggml_tensor * ggml_fill_inplace(ggml_context * ctx, ggml_tensor * a, float c);
ggml_tensor * ggml_diag_mask_inf(ggml_context * ctx, ggml_tensor * a, int n_past);
ggml_tensor * ggml_soft_max(ggml_context * ctx, ggml_tensor * a);
ggml_tensor * ggml_soft_max_ext(ggml_context * ctx, ggml_tensor * a, ggml_tensor * mask, float scale, float max_bias);
ggml_tensor * ggml_rope_ext(ggml_context * ctx, ggml_tensor * a, ggml_tensor * b, ggml_tensor * c,
    int n_dims, int mode, int n_ctx_orig, float freq_base, float freq_scale, float ext_factor,
    float attn_factor, float beta_fast, float beta_slow);
ggml_tensor * ggml_swiglu_split(ggml_context * ctx, ggml_tensor * a, ggml_tensor * b);
ggml_tensor * ggml_cross_entropy_loss(ggml_context * ctx, ggml_tensor * a, ggml_tensor * b);
ggml_tensor * ggml_opt_step_adamw(ggml_context * ctx, ggml_tensor * a, ggml_tensor * grad,
    ggml_tensor * m, ggml_tensor * v, ggml_tensor * adamw_params);

ggml_cgraph * ggml_new_graph_custom(ggml_context * ctx, size_t size, bool grads);
ggml_cgraph * ggml_graph_dup(ggml_context * ctx, ggml_cgraph * cgraph, bool force_grads);
void ggml_graph_cpy(ggml_cgraph * src, ggml_cgraph * dst);
int ggml_graph_size(ggml_cgraph * cgraph);
void ggml_build_forward_expand(ggml_cgraph * cgraph, ggml_tensor * tensor);
void ggml_build_backward_expand(ggml_context * ctx, ggml_cgraph * cgraph, ggml_tensor ** grad_accs);
void ggml_graph_reset(ggml_cgraph * cgraph);
int ggml_graph_n_nodes(ggml_cgraph * cgraph);
ggml_tensor * ggml_graph_node(ggml_cgraph * cgraph, int i);
ggml_tensor * ggml_graph_get_grad(const ggml_cgraph * cgraph, const ggml_tensor * node);
ggml_tensor * ggml_graph_get_grad_acc(const ggml_cgraph * cgraph, const ggml_tensor * node);

ggml_backend_t ggml_backend_init_by_name(const char * name, const char * params);
ggml_backend_t ggml_backend_cpu_init(void);
void ggml_backend_cpu_set_n_threads(ggml_backend_t backend_cpu, int n_threads);
const char * ggml_backend_name(ggml_backend_t backend);
void ggml_backend_free(ggml_backend_t backend);
ggml_backend_buffer_type_t ggml_backend_get_default_buffer_type(ggml_backend_t backend);
ggml_backend_dev_t ggml_backend_dev_by_name(const char * name);
size_t ggml_backend_dev_count(void);
ggml_backend_dev_t ggml_backend_dev_get(size_t index);
const char * ggml_backend_dev_name(ggml_backend_dev_t device);
const char * ggml_backend_dev_description(ggml_backend_dev_t device);
ggml_backend_dev_t ggml_backend_get_device(ggml_backend_t backend);
int ggml_backend_graph_compute(ggml_backend_t backend, ggml_cgraph * cgraph);
void ggml_backend_synchronize(ggml_backend_t backend);
bool ggml_backend_supports_op(ggml_backend_t backend, const ggml_tensor * op);
ggml_backend_buffer_t ggml_backend_alloc_ctx_tensors(ggml_context * ctx, ggml_backend_t backend);
ggml_backend_buffer_t ggml_backend_cpu_buffer_from_ptr(void * ptr, size_t size);
int ggml_backend_tensor_alloc(ggml_backend_buffer_t buffer, ggml_tensor * tensor, void * addr);
void ggml_backend_buffer_free(ggml_backend_buffer_t buffer);
void ggml_backend_buffer_clear(ggml_backend_buffer_t buffer, uint8_t value);
size_t ggml_backend_buffer_get_size(ggml_backend_buffer_t buffer);
void ggml_backend_tensor_set(ggml_tensor * tensor, const void * data, size_t offset, size_t size);
void ggml_backend_tensor_get(const ggml_tensor * tensor, void * data, size_t offset, size_t size);
void ggml_backend_tensor_memset(ggml_tensor * tensor, uint8_t value, size_t offset, size_t size);

ggml_gallocr_t ggml_gallocr_new(ggml_backend_buffer_type_t buft);
void ggml_gallocr_free(ggml_gallocr_t galloc);
bool ggml_gallocr_reserve(ggml_gallocr_t galloc, ggml_cgraph * graph);
bool ggml_gallocr_alloc_graph(ggml_gallocr_t galloc, ggml_cgraph * graph);
size_t ggml_gallocr_get_buffer_size(ggml_gallocr_t galloc, int buffer_id);
void ggml_gallocr_reserve_n_size(ggml_gallocr_t galloc, ggml_cgraph * graph, const int * node_buffer_ids,
                                 const int * leaf_buffer_ids, size_t * sizes);
size_t ggml_backend_alloc_ctx_tensors_from_buft_size(ggml_context * ctx, ggml_backend_buffer_type_t buft);
size_t ggml_backend_buft_get_alloc_size(ggml_backend_buffer_type_t buft, const ggml_tensor * tensor);
size_t ggml_backend_buft_get_alignment(ggml_backend_buffer_type_t buft);
ggml_tensor * ggml_get_first_tensor(const ggml_context * ctx);
ggml_tensor * ggml_get_next_tensor(const ggml_context * ctx, ggml_tensor * tensor);
void ggml_backend_dev_memory(ggml_backend_dev_t device, size_t * free, size_t * total);

int ggml_cpu_has_avx(void);
int ggml_cpu_has_avx2(void);
int ggml_cpu_has_avx512(void);
int ggml_cpu_has_avx512_bf16(void);
int ggml_cpu_has_fma(void);
int ggml_cpu_has_neon(void);
int ggml_cpu_has_sve(void);
int ggml_cpu_has_llamafile(void);

int th_tensor_type(const ggml_tensor * t);
void th_tensor_shape(const ggml_tensor * t, int64_t ne[4], size_t nb[4]);
ggml_tensor * th_tensor_src(const ggml_tensor * t, int i);
void * th_tensor_data(const ggml_tensor * t);
int th_tensor_has_buffer(const ggml_tensor * t);
int th_tensor_flags(const ggml_tensor * t);
int th_tensor_op(const ggml_tensor * t);
int th_graph_n_leafs(const ggml_cgraph * graph);
int th_tensor_is_host(const ggml_tensor * t);
void th_zero_tensors(ggml_tensor ** ts, int n);
int64_t th_feed_f32(ggml_tensor * t, const float * x, int64_t n);
int64_t th_feed_ids(ggml_tensor * t, const int64_t * ids, int64_t n, int64_t upper, int32_t * scratch);
void th_link_packed_bounds(ggml_tensor * mask, const ggml_tensor * bounds);
int64_t th_feed_targets(ggml_tensor * onehot, float * mirror, ggml_tensor * flat_index, const int64_t * ids,
                        int64_t * last, int has_last, int64_t n, int64_t vocab, int32_t * scratch);
void th_install_abort_handler(void);
void th_set_log_level(int min_level);
void th_clear_ctx_alloc(ggml_context * ctx);
double th_node_matmul_flops(const ggml_tensor * t);
const char * th_kernel_name(const ggml_tensor * t);
void th_set_sgemm(void * fn);
void th_gemm_cut(int64_t M, int64_t N, int64_t * rows, int64_t * cols);
int th_cpu_rewrite(ggml_cgraph * graph);
int th_cpu_soft_max_back_in_place_ok(const ggml_tensor * t);
ggml_tensor * th_dropout_mask(ggml_context * ctx, ggml_tensor * key, int64_t ne0, int64_t ne1, int64_t ne2,
                              int64_t ne3, uint32_t node, uint64_t threshold, float kept);
void th_philox4x32_10_block(uint32_t c[4], uint32_t k0, uint32_t k1);
int th_cpu_fold(ggml_cgraph * graph);
int th_portable_rewrite(ggml_cgraph * graph, char * why, size_t why_len);
int th_portable_first_unsupported(ggml_cgraph * graph);
int th_cont_strided_operands(ggml_context * ctx, ggml_cgraph * graph, int apply);
const char * th_portable_kernel_name(const ggml_tensor * t);
int th_frozen_type_ok(int type);
int64_t th_frozen_tile(int64_t n, int64_t m);
int th_dequantize_row(int type, const void * src, float * dst, int64_t n, int fast);
int th_chunked_cross_entropy(ggml_context * ctx, ggml_tensor * logits, ggml_tensor * ids, ggml_tensor * mask,
                             ggml_tensor * count, ggml_tensor ** hidden, ggml_tensor ** grad,
                             ggml_tensor ** row_loss, char * why, int why_len);
int th_portable_dequantize(int type, const void * src, float * dst, int64_t n);
int th_graph_profile(ggml_backend_t backend, ggml_cgraph * graph, double * us_per_node);
int64_t th_column_sum_rows(const ggml_tensor * t);
int th_cuda_rewrite(ggml_cgraph * graph, int flags);
const char * th_cuda_kernel_name(const ggml_tensor * t);
int th_cuda_mark_precision(ggml_cgraph * graph, int precision, char * why, int why_size);
int th_cuda_precision_of(const ggml_tensor * t);
int th_cudnn_attention_built(void);
void th_set_cudnn_attention(int mode);
void th_cuda_set_cudnn_attention(int mode);
int th_cuda_kernels_version(void);
void th_cuda_linear_bias_calls(int64_t * lt, int64_t * plain);
void th_cuda_bf16_copies(int64_t * converted, int64_t * reused);
int64_t th_cuda_bf16_copy_bytes(void);
int64_t th_cuda_bf16_scratch_bytes(void);
int64_t th_cuda_bf16_copy_peak_bytes(void);
int64_t th_cuda_bf16_copies_alone(void);
void th_cuda_bf16_keep_nodes(int nodes);
int th_cuda_dequantize_bf16(int type, const void * src, int64_t n, uint16_t * dst, int ours);
int64_t th_cuda_frozen_products(void);
int th_column_sum_as_out_prod(ggml_tensor * t, ggml_tensor * ones);
int th_row_sum_as_sum_rows(ggml_tensor * t);
int th_lowering_new_tensors(const ggml_cgraph * g, ggml_tensor * repl, ggml_tensor ** out, int max);
int th_lowering_splice(ggml_cgraph * g, ggml_tensor * node, ggml_tensor * repl);
void th_lowering_op_params(const ggml_tensor * t, int32_t * out);
double th_cpu_round_trip_ns(int cpu_a, int cpu_b, int rounds);
const char * ggml_op_desc(const ggml_tensor * t);
"""

GGML_TYPE_F32 = 0
GGML_TYPE_F16 = 1
GGML_TYPE_Q8_0 = 8
GGML_TYPE_Q4_K = 12
GGML_TYPE_I32 = 26
GGML_TYPE_BF16 = 30
GGML_TYPE_COUNT = 43
GGML_LOG_LEVEL_WARN = 3
GGML_STATUS_SUCCESS = 0
GGML_ROPE_TYPE_NORMAL = 0
GGML_ROPE_TYPE_NEOX = 2
GGML_MAX_NAME = 64

NATIVE_DIR = Path(switch("TOYHARNESS_NATIVE_DIR") or Path(__file__).resolve().parent / "_native")

# Loaded in dependency order (each also finds the others through its $ORIGIN rpath).
_LOAD_ORDER = ("libggml-base.so", "libggml-cpu.so", "libggml-cuda.so", "libggml-vulkan.so",
               "libggml-metal.so",
               "libggml-blas.so", "libggml.so", "libtoyharness_shim.so")


class NativeLibraryMissing(ImportError):
    pass


class _Symbols:
    """Looks each symbol up in the loaded libraries in turn and caches the function.

    Every declared function is looked up once, up front: cffi's first lookup of a symbol holds
    a non-reentrant lock, and a garbage-collected Program whose __del__ frees ggml memory
    during that lookup deadlocked the process (seen in the test suite)."""

    def __init__(self, handles, names=()):
        self._handles = handles
        for name in names:
            with contextlib.suppress(AttributeError):   # e.g. a backend's symbol this build lacks
                getattr(self, name)

    def __getattr__(self, name):
        for handle in self._handles:
            try:
                fn = getattr(handle, name)
            except AttributeError:
                continue
            setattr(self, name, fn)
            return fn
        raise AttributeError(f"symbol {name} not found in the toyharness native libraries")


def log_level() -> int:
    """The least level of ggml's log messages shown (TOYHARNESS_GGML_LOG, default warnings)."""
    return int(switch("TOYHARNESS_GGML_LOG"))


def _load():
    # ggml-vulkan rounds f32 operands of products to f16 on devices with f16 arithmetic (lavapipe
    # included: 3e-4 relative error in a product, 1e-5 in a gpt2 golden's losses); it reads this
    # when it creates a device, and with it set the products are f32 (1.7e-7 from the cpu goldens).
    os.environ["GGML_VK_DISABLE_F16"] = "1"
    ffi = FFI()
    ffi.cdef(CDEF)
    if not NATIVE_DIR.is_dir():
        raise NativeLibraryMissing(
            f"toyharness native libraries not found in {NATIVE_DIR}: reinstall the package "
            "(pip install -e .) so that native/build.py runs")
    handles = []
    found = {p.name.split(".so")[0] + ".so": p for p in NATIVE_DIR.glob("lib*.so*")}
    for name in _LOAD_ORDER:
        if name in found:
            # RTLD_LOCAL: ggml's libgomp must not bind the OpenMP runtime that torch or
            # scikit-learn bring (mixed versions crash with "free(): invalid pointer").
            handles.append(ffi.dlopen(str(found[name]), ffi.RTLD_NOW | ffi.RTLD_LOCAL))
    if "libtoyharness_shim.so" not in found:
        raise NativeLibraryMissing(f"libtoyharness_shim.so missing from {NATIVE_DIR}")
    lib = _Symbols(handles, re.findall(r"\b(\w+)\s*\(", CDEF))
    lib.th_install_abort_handler()
    lib.th_set_log_level(log_level())
    return ffi, lib, handles


ffi, lib, _handles = _load()


class Blas:
    """OpenBLAS from the scipy-openblas32 wheel, driving the cpu backend's f32 matrix products
    (see th_gemm_op in native/cpu_kernels.c). Single-threaded: ggml's threads split the work."""

    def __init__(self, package_dir: Path, version: str):
        path = next((package_dir / "lib").glob("libscipy_openblas*.so*"))
        # RTLD_LOCAL (ctypes; cffi's dlopen made it global): other OpenBLAS copies in the process
        # (scipy's) must not bind to this one's symbols: mixed versions crash in free().
        self.lib = ctypes.CDLL(str(path), mode=os.RTLD_NOW | os.RTLD_LOCAL)
        self.lib.scipy_openblas_set_num_threads(1)
        self.lib.scipy_openblas_get_corename.restype = ctypes.c_char_p
        self.version = version
        self.corename = self.lib.scipy_openblas_get_corename().decode()
        self.sgemm = self.lib.scipy_cblas_sgemm
        self.sgemm.restype = None
        self.sgemm.argtypes = [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                                                     ctypes.c_int, ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
        lib.th_set_sgemm(ffi.cast("void *", ctypes.cast(self.sgemm, ctypes.c_void_p).value))

    def tag(self) -> str:
        return f"openblas-{self.corename.lower()}"


def _load_blas() -> Blas | None:
    # Found, not imported: the package's __init__ loads the library RTLD_GLOBAL.
    import importlib.metadata
    import importlib.util

    spec = importlib.util.find_spec("scipy_openblas32")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Blas(Path(list(spec.submodule_search_locations)[0]), importlib.metadata.version("scipy-openblas32"))


blas = _load_blas()


# native/custom_ops.h's TH_CUDA_KERNELS_VERSION: the stand-ins this toyharness builds
CUDA_KERNELS_VERSION = 26
GGML_MAX_SRC = 10                # ggml.h: the sources a node holds


def cuda_kernels_built() -> bool:
    """Whether the loaded ggml-cuda carries our kernels (native/cuda/th-custom.cu, patched in by
    native/build.py), at least those this toyharness builds stand-ins for: a ggml-cuda built
    otherwise (or earlier) leaves GELU and LayerNorm composed from ggml's ops."""
    try:
        return lib.th_cuda_kernels_version() >= CUDA_KERNELS_VERSION
    except AttributeError:
        return False


# TOYHARNESS_CUDNN_ATTENTION's values as native/custom_ops.h's TH_CUDNN_OFF, _ON and _REFUSE
CUDNN_ATTENTION_MODES = {"0": 0, "1": 1, "refuse": 2}


def pass_switches() -> None:
    """Hand the native libraries the switches they act on (native code never reads the environment):
    TOYHARNESS_CUDNN_ATTENTION, to the shim and to ggml-cuda where this build has it. Called as each
    cuda program starts, so that a value set since (a test's) takes effect."""
    mode = CUDNN_ATTENTION_MODES[switch("TOYHARNESS_CUDNN_ATTENTION")]
    for setter in ("th_set_cudnn_attention", "th_cuda_set_cudnn_attention"):
        with contextlib.suppress(AttributeError):       # a build without cuda
            getattr(lib, setter)(mode)


def available_native_backends() -> list[str]:
    """Backends compiled into the loaded libraries (cpu always)."""
    names = ["cpu"]
    for i in range(lib.ggml_backend_dev_count()):
        dev_name = ffi.string(lib.ggml_backend_dev_name(lib.ggml_backend_dev_get(i))).decode().lower()
        if dev_name.startswith("cuda") and "cuda" not in names:
            names.append("cuda")
        if dev_name.startswith("vulkan") and "vulkan" not in names:
            names.append("vulkan")
        if dev_name.startswith("metal") and "metal" not in names:
            names.append("metal")
    return names


# ggml creates its cuBLAS handle in TF32 mode (CUBLAS_TF32_TENSOR_OP_MATH): 1e-3 relative error per
# product, far from the cpu goldens. Our dispatch sets each product node's math mode from its
# program's precision (native/cuda/th-precision.cu: fp32 unless the program asked for tf32 or
# bf16). A ggml-cuda built without it keeps the old guard, which turns TF32 off for the process.
if "cuda" in available_native_backends() and not cuda_kernels_built():
    os.environ.setdefault("NVIDIA_TF32_OVERRIDE", "0")
