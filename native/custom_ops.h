/* What the cpu side (the shim's rewrite, native/cuda_rewrite.c) and our cuda kernels
 * (native/cuda/th-custom.cu, built inside ggml-cuda) agree on: how a GGML_OP_CUSTOM node is
 * marked as ours, which kernel it is, and the GELU constants both sides' formula uses. */
#pragma once

#include "ggml.h"

#define TH_CUDA_MAGIC 0x75636874          /* "thcu", op_params[0] of a node of ours */
#define TH_CUDA_KERNELS_VERSION 2
enum { TH_CUDA_GELU = 1, TH_CUDA_GELU_BACK = 2, TH_CUDA_CONT = 3 };

#define TH_GELU_K1 1.5957691216057308f   /* 2 sqrt(2 / pi) */
#define TH_GELU_K3 0.0713548162726009f   /* 0.044715 * 2 sqrt(2 / pi) */

/* CONT of a permuted f32 tensor: the source's axis whose elements are adjacent (stride one float):
 * 0 (rows contiguous: a row copy), 1..3 (a transpose through tiles), -1 when none is. */
static inline int th_cont_axis(const struct ggml_tensor * src) {
    if (src->nb[0] == sizeof(float)) return 0;
    for (int c = 1; c < 4; c++) {
        if (src->ne[c] > 1 && src->nb[c] == sizeof(float)) return c;
    }
    return -1;
}
