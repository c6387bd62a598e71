/* litekv's quantized linears (linear.c) as ONNX Runtime custom ops, in the domain "litekv".
 *
 * ONNX Runtime's one-token int4 projection is MatMulNBits plus, for an exact asymmetric grid, a
 * block-sum matmul and an add: four nodes a projection, each paying ONNX Runtime's per-node cost.
 * These ops read the same weights in one call, on the two threads of litekv's attention state.
 *
 *   "LinearInt4": x f32 [.., in], codes uint8 [out, ..] (in / 2 bytes a row: MatMulNBits' B, each
 *                 nibble code + 8, the even element low), block scales f16 [out, blocks], offsets
 *                 int8 [out, blocks], offset scales f32 [out]  ->  y f32 [.., out]
 *   "LinearInt8": x f32 [.., in], codes int8 [out, in], row scales f32 [out]  ->  y f32 [.., out]
 *
 * LinearInt4's int attribute `gate` (GATE_SILU, GATE_GELU_TANH) makes it a gated MLP's first half:
 * with h = out / 2, y [.., h] = act(rows [0, h)) * rows [h, out), in place of two slices, the
 * activation and a product, which would each cost a node.
 *
 * Both linears take the RMSNorm before them (SkipSimplifiedLayerNormalization's contract), in two
 * optional inputs after the weights, skip f32 [.., in] and norm weight f32 [in], with the float
 * attribute `epsilon`: s = x + skip, y = linear(s / sqrt(mean(s^2) + epsilon) * weight), and the
 * optional second output is s, the residual stream. A decode step's norms are a node each
 * otherwise, 5 us apiece for 576 floats, nearly all of it ONNX Runtime's cost of a node.
 *
 *   "DecodeAttention", "PrefillAttention": attention over a float32 cache in GroupQueryAttention's
 *                 layout, which they replace in the graphs (a step's GroupQueryAttention took 52 us a
 *                 layer at 320 tokens on one thread; litekv's kernels run on two). Decode takes one
 *                 token (litekv's decode kernel, on its helper thread), prefill a chunk of T (its
 *                 prefill kernel, on ONNX Runtime's pool: KernelContext_ParallelFor).
 *                 query f32 [1, T, H*D], or [1, T, (H + 2 KVH) * D] with q, k and v packed; key and
 *                 value f32 [1, T, KVH*D] (absent when packed); past_key, past_value f32
 *                 [1, KVH, S, D]; seqlens_k int32 [1] (the last token's slot); cos, sin f32
 *                 [P, R/2] (absent: no RoPE)  ->  out f32 [1, T, H*D], present_key, present_value.
 *                 Int attributes num_heads, kv_num_heads, local_window_size (-1: none), float
 *                 scale. RoPE (rotate-half over the first R elements of each head) goes on q and k,
 *                 the scale on q; the chunk's k and v rows are written at slots seqlens_k - T + 1 ..
 *                 seqlens_k, and the token at slot p attends to slots p - window + 1 .. p. Bound to
 *                 the same buffer as past (as GroupQueryAttention's are), present is written in
 *                 place; otherwise past is copied into it first.
 *   "DecodeAttentionInt8", "PrefillAttentionInt8": the same over GroupQueryAttention's int8 cache:
 *                 past and present int8 codes, then two more inputs, k_scale and v_scale f32
 *                 [1, KVH, 1, D] (a static scale per KV head and channel). New rows are quantized as
 *                 they are written; the keys' scales are folded into the query and the values' into
 *                 the output, so the kernels read the codes as they are (a quarter of a float32
 *                 cache's bytes). Int attribute key_blocks (default 0): 1 stores the key codes in
 *                 blocks of slots (attention_common.h's key_block_offset, per KV head), which
 *                 litekv's AVX2 decode path scores without reduction trees; S a multiple of 8.
 *
 *   "LinearF32": x f32 [.., in], weight f32 [out, in] (W itself: an LM head's, or the tied embedding
 *                 table the graph's Gather reads)  ->  y f32 [.., out], with the same optional norm
 *                 inputs as the others: an fp32 LM head's one row, streamed at the machine's read rate.
 *   Every linear's int attribute `on_pool` (default 0) puts its rows on ONNX Runtime's pool, for
 *   graphs whose session has one (the converter sets it there); 0 shares them with litekv's helper
 *   thread, in the decode graph whose session runs on one thread.
 *   "Gate": x f32 [.., 2h]  ->  act(x [.., :h]) * x [.., h:], f32 [.., h], int attribute `gate` as
 *                 LinearInt4's: a gated MLP's activation over a projection of ONNX Runtime's own.
 *
 *   "Int4Offsets": y f32 [.., out] (MatMulNBits' output), x f32 [.., in] (its input), offsets int8
 *                 [out, blocks], offset scales f32 [out]  ->  y plus the offsets' share of an int4
 *                 projection (LinearInt4's W), f32 [.., out]: a prefill chunk's projection is then
 *                 MatMulNBits and this op, on ONNX Runtime's pool (int4_offsets.c).
 *
 * The library is the one Python loads with ctypes: litekv_ort_prepare() names the AttentionConfig
 * the next registration uses, then SessionOptions.register_custom_ops_library(path) calls
 * RegisterCustomOps, and litekv_ort_take() hands the registration back, for litekv_ort_release()
 * once every session using it is gone. ONNX Runtime's headers are not needed: the few entry points
 * used are addressed by their slot in OrtApi, which only ever grows at its end (API version 16). */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attention_common.h"
#include "linear.h"

#define ORT_API_VERSION_USED 16 /* ONNX Runtime 1.16: CreateKernelV2 / KernelComputeV2 */
#define MAX_RANK 8

typedef struct OrtStatus OrtStatus;
typedef struct OrtApi OrtApi; /* a table of function pointers; see the slots below */
typedef struct {
    const OrtApi *(*GetApi)(uint32_t version);
    const char *(*GetVersionString)(void);
} OrtApiBase;

/* Slots of the OrtApi functions used (index of the pointer in the table). */
enum {
    SLOT_CREATE_STATUS = 0,
    SLOT_CREATE_CUSTOM_OP_DOMAIN = 26,
    SLOT_CUSTOM_OP_DOMAIN_ADD = 27,
    SLOT_ADD_CUSTOM_OP_DOMAIN = 28,
    SLOT_GET_TENSOR_MUTABLE_DATA = 51,
    SLOT_GET_TENSOR_ELEMENT_TYPE = 60,
    SLOT_GET_DIMENSIONS_COUNT = 61,
    SLOT_GET_DIMENSIONS = 62,
    SLOT_GET_TENSOR_TYPE_AND_SHAPE = 65,
    SLOT_KERNEL_INFO_GET_ATTRIBUTE_FLOAT = 85,
    SLOT_KERNEL_INFO_GET_ATTRIBUTE_INT64 = 86,
    SLOT_KERNEL_CONTEXT_GET_INPUT_COUNT = 88,
    SLOT_KERNEL_CONTEXT_GET_OUTPUT_COUNT = 89,
    SLOT_KERNEL_CONTEXT_GET_INPUT = 90,
    SLOT_KERNEL_CONTEXT_GET_OUTPUT = 91,
    SLOT_RELEASE_STATUS = 93,
    SLOT_RELEASE_TENSOR_TYPE_AND_SHAPE_INFO = 99,
    SLOT_RELEASE_CUSTOM_OP_DOMAIN = 101,
    SLOT_KERNEL_CONTEXT_PARALLEL_FOR = 274, /* ONNX Runtime 1.17 */
};
#define API(api, slot, type) ((type)((void *const *)(const void *)(api))[slot])

enum { ORT_FAIL = 1, ORT_INVALID_ARGUMENT = 2, ORT_RUNTIME_EXCEPTION = 6 };
enum { TYPE_FLOAT = 1, TYPE_UINT8 = 2, TYPE_INT8 = 3, TYPE_INT32 = 6, TYPE_FLOAT16 = 10 };
enum { REQUIRED = 0, OPTIONAL = 1 }; /* OrtCustomOpInputOutputCharacteristic */
enum {
    KIND_LINEAR_INT4,
    KIND_LINEAR_INT8,
    KIND_DECODE_ATTENTION,
    KIND_PREFILL_ATTENTION,
    KIND_DECODE_ATTENTION_INT8,
    KIND_PREFILL_ATTENTION_INT8,
    KIND_INT4_OFFSETS,
    KIND_LINEAR_F32,
    KIND_GATE,
    KIND_LINEAR_F32_SCREENED,
    KINDS
};
enum { GATE_NONE = 0, GATE_SILU = LINEAR_GATE_SILU, GATE_GELU_TANH = LINEAR_GATE_GELU_TANH }; /* emit_onnx.GATES */

/* OrtCustomOp, as far as version 16 reads it. */
typedef struct CustomOp {
    uint32_t version;
    void *(*CreateKernel)(const struct CustomOp *, const OrtApi *, const void *);
    const char *(*GetName)(const struct CustomOp *);
    const char *(*GetExecutionProviderType)(const struct CustomOp *);
    int (*GetInputType)(const struct CustomOp *, size_t);
    size_t (*GetInputTypeCount)(const struct CustomOp *);
    int (*GetOutputType)(const struct CustomOp *, size_t);
    size_t (*GetOutputTypeCount)(const struct CustomOp *);
    void (*KernelCompute)(void *, void *);
    void (*KernelDestroy)(void *);
    int (*GetInputCharacteristic)(const struct CustomOp *, size_t);
    int (*GetOutputCharacteristic)(const struct CustomOp *, size_t);
    int (*GetInputMemoryType)(const struct CustomOp *, size_t);
    int (*GetVariadicInputMinArity)(const struct CustomOp *);
    int (*GetVariadicInputHomogeneity)(const struct CustomOp *);
    int (*GetVariadicOutputMinArity)(const struct CustomOp *);
    int (*GetVariadicOutputHomogeneity)(const struct CustomOp *);
    OrtStatus *(*CreateKernelV2)(const struct CustomOp *, const OrtApi *, const void *, void **);
    OrtStatus *(*KernelComputeV2)(void *, void *);
    void *later[9]; /* fields of versions after 16, left NULL */
} CustomOp;

int litekv_linear_run(void *cfg, int format, const float *x, float *y, const void *codes, const uint16_t *block_scales,
                      const int8_t *offsets, const float *row_scales, int tokens, int in, int out, int block,
                      const LentThreads *lent);
int litekv_attention_head_major(void *cfg, const float *query, const void *keys, const void *values, float *out,
                                int heads, int kv_heads, int slots, int head_dim, int lo, int hi, int cache_type,
                                const LentThreads *lent);
int litekv_screened_head_run(void *cfg, const float *x, float *y, const float *w, const int8_t *codes,
                             const float *row_scales, const float *bounds, int keep, int in, int out,
                             const LentThreads *lent, int *computed);

/* One op of one registration: ONNX Runtime hands `op` back to every callback, so the rest is ours. */
typedef struct {
    CustomOp op;
    const OrtApi *api;
    void *config; /* the AttentionConfig whose state (scratch, helper thread) runs the kernels */
    struct Registration *registration;
    int kind;
} Op;

/* Floats of working memory, under call_lock, grown to the widest call (once per model). */
typedef struct {
    float *data;
    size_t floats;
} Scratch;

typedef struct Registration {
    Op ops[KINDS]; /* by kind */
    const OrtApi *api;
    void *domain;
    Scratch rows;   /* a gated linear's rows before the gate, or a step's rotated query */
    Scratch normed; /* a linear's normalized input */
    Scratch prefill[2]; /* the prefill kernel's scratch of each of its two workers (64-byte aligned) */
    Scratch sums, offsets[2]; /* Int4Offsets: the block sums, and each worker's converted offsets */
    Scratch key_rows; /* PrefillAttentionInt8 with key_blocks: the cache's keys as rows, for the prefill kernel */
} Registration;

/* One node's kernel: its op and its attributes. */
typedef struct {
    const Op *op;
    Registration *registration;
    int gate;                      /* LinearInt4, Gate */
    int on_pool;                   /* linears: rows on ONNX Runtime's pool (1), or litekv's helper (0) */
    float epsilon;                 /* linears with a norm */
    int heads, kv_heads, window;   /* attention; window 0: none */
    int key_blocks;                /* int8 attention: key codes in blocks of slots */
    float scale;
} Kernel;

static _Atomic(void *) pending_config, last_registration;
/* One call at a time: sessions run from any thread, and a bundle's two sessions (prefill, decode)
 * share one state, whose job, scratch and helper thread serve one call. */
static pthread_mutex_t call_lock = PTHREAD_MUTEX_INITIALIZER;

static OrtStatus *error(const OrtApi *api, int code, const char *message) {
    return API(api, SLOT_CREATE_STATUS, OrtStatus * (*)(int, const char *))(code, message);
}

#define CHECK(call)                  \
    do {                             \
        OrtStatus *status_ = (call); \
        if (status_) return status_; \
    } while (0)

/* ---- the ops' descriptions --------------------------------------------------------------------- */

static int kind_of(const CustomOp *op) { return ((const Op *)(const void *)op)->kind; }

static const char *op_name(const CustomOp *op) {
    static const char *const names[] = {"LinearInt4",          "LinearInt8",          "DecodeAttention",
                                        "PrefillAttention",    "DecodeAttentionInt8", "PrefillAttentionInt8",
                                        "Int4Offsets",         "LinearF32",           "Gate",
                                        "LinearF32Screened"};
    return names[kind_of(op)];
}

static const char *op_provider(const CustomOp *op) {
    (void)op;
    return NULL; /* the CPU execution provider */
}

/* x, the weights, then the norm's skip and weight */
static const int linear_int4_inputs[] = {TYPE_FLOAT, TYPE_UINT8, TYPE_FLOAT16, TYPE_INT8,
                                         TYPE_FLOAT, TYPE_FLOAT,  TYPE_FLOAT};
static const int linear_int8_inputs[] = {TYPE_FLOAT, TYPE_INT8, TYPE_FLOAT, TYPE_FLOAT, TYPE_FLOAT};
static const int linear_f32_inputs[] = {TYPE_FLOAT, TYPE_FLOAT, TYPE_FLOAT, TYPE_FLOAT};
static const int gate_inputs[] = {TYPE_FLOAT};
/* x, W, the screen's codes, row scales and bounds, keep (decode_attention.c: compute_screened_head) */
static const int linear_f32_screened_inputs[] = {TYPE_FLOAT, TYPE_FLOAT, TYPE_INT8,  TYPE_FLOAT,
                                                 TYPE_FLOAT, TYPE_INT32, TYPE_FLOAT, TYPE_FLOAT};
/* query, key, value, past_key, past_value, seqlens_k, cos, sin */
static const int attention_inputs[] = {TYPE_FLOAT, TYPE_FLOAT, TYPE_FLOAT, TYPE_FLOAT,
                                       TYPE_FLOAT, TYPE_INT32, TYPE_FLOAT, TYPE_FLOAT};
/* ... an int8 cache's codes, then its static scales per KV head and channel [1, KVH, 1, D] */
static const int attention_int8_inputs[] = {TYPE_FLOAT, TYPE_FLOAT, TYPE_FLOAT, TYPE_INT8, TYPE_INT8,
                                            TYPE_INT32, TYPE_FLOAT, TYPE_FLOAT, TYPE_FLOAT, TYPE_FLOAT};
/* y (MatMulNBits' output), x (its input), offsets, offset scales */
static const int int4_offsets_inputs[] = {TYPE_FLOAT, TYPE_FLOAT, TYPE_INT8, TYPE_FLOAT};
enum { ATTN_QUERY, ATTN_KEY, ATTN_VALUE, ATTN_PAST_KEY, ATTN_PAST_VALUE, ATTN_SEQLENS, ATTN_COS, ATTN_SIN,
       ATTN_K_SCALE, ATTN_V_SCALE };

static size_t op_input_count(const CustomOp *op) {
    static const size_t counts[] = {7, 5, 8, 8, 10, 10, 4, 4, 1, 8};
    return counts[kind_of(op)];
}

/* A linear's inputs before the norm's: x and its weights. */
static size_t linear_weight_inputs(int kind) {
    return kind == KIND_LINEAR_INT8 ? 3 : kind == KIND_LINEAR_F32 ? 2 : kind == KIND_LINEAR_F32_SCREENED ? 6 : 5;
}

static int op_input_type(const CustomOp *op, size_t index) {
    static const int *const types[] = {linear_int4_inputs,  linear_int8_inputs,    attention_inputs,
                                       attention_inputs,    attention_int8_inputs, attention_int8_inputs,
                                       int4_offsets_inputs, linear_f32_inputs,     gate_inputs,
                                       linear_f32_screened_inputs};
    return index < op_input_count(op) ? types[kind_of(op)][index] : 0;
}

static int is_int8_attention(int kind) {
    return kind == KIND_DECODE_ATTENTION_INT8 || kind == KIND_PREFILL_ATTENTION_INT8;
}

static int is_attention(int kind) {
    return kind == KIND_DECODE_ATTENTION || kind == KIND_PREFILL_ATTENTION || is_int8_attention(kind);
}

static int is_linear(int kind) {
    return kind == KIND_LINEAR_INT4 || kind == KIND_LINEAR_INT8 || kind == KIND_LINEAR_F32 ||
           kind == KIND_LINEAR_F32_SCREENED;
}

static size_t op_output_count(const CustomOp *op) {
    return is_attention(kind_of(op)) ? 3 : is_linear(kind_of(op)) ? 2 : 1;
}

static int op_output_type(const CustomOp *op, size_t index) {
    return is_int8_attention(kind_of(op)) && index > 0 ? TYPE_INT8 : TYPE_FLOAT; /* present codes */
}

static int op_input_characteristic(const CustomOp *op, size_t index) {
    if (is_linear(kind_of(op))) return index < linear_weight_inputs(kind_of(op)) ? REQUIRED : OPTIONAL;
    if (!is_attention(kind_of(op))) return REQUIRED;
    const int optional = index == ATTN_KEY || index == ATTN_VALUE || index == ATTN_COS || index == ATTN_SIN;
    return optional ? OPTIONAL : REQUIRED;
}

static int op_output_characteristic(const CustomOp *op, size_t index) {
    return is_linear(kind_of(op)) && index == 1 ? OPTIONAL : REQUIRED; /* a linear's residual sum */
}

static int op_memory_type(const CustomOp *op, size_t index) {
    (void)op;
    (void)index;
    return 0; /* OrtMemTypeDefault */
}

/* An int attribute, or `fallback` where the node has none. */
static int64_t int_attribute(const OrtApi *api, const void *info, const char *name, int64_t fallback) {
    int64_t value = fallback;
    OrtStatus *absent = API(api, SLOT_KERNEL_INFO_GET_ATTRIBUTE_INT64,
                            OrtStatus * (*)(const void *, const char *, int64_t *))(info, name, &value);
    if (absent) API(api, SLOT_RELEASE_STATUS, void (*)(OrtStatus *))(absent), value = fallback;
    return value;
}

static OrtStatus *op_create_kernel(const CustomOp *custom, const OrtApi *api, const void *info, void **kernel) {
    const Op *op = (const Op *)(const void *)custom;
    Kernel k = {op, op->registration, GATE_NONE, 0, 1e-6f, 0, 0, 0, 0.0f};
    if (op->kind == KIND_LINEAR_INT4 || op->kind == KIND_GATE) {
        const int64_t gate = int_attribute(api, info, "gate", GATE_NONE);
        if ((gate != GATE_NONE || op->kind == KIND_GATE) && gate != GATE_SILU && gate != GATE_GELU_TANH)
            return error(api, ORT_INVALID_ARGUMENT, "litekv linear: unknown gate (1 = silu, 2 = gelu_tanh)");
        k.gate = (int)gate;
    }
    if (is_linear(op->kind)) {
        const int64_t on_pool = int_attribute(api, info, "on_pool", 0);
        if (on_pool != 0 && on_pool != 1)
            return error(api, ORT_INVALID_ARGUMENT, "litekv linear: on_pool must be 0 (litekv's helper thread) or 1 "
                                                    "(the session's pool)");
        k.on_pool = (int)on_pool;
        OrtStatus *absent = API(api, SLOT_KERNEL_INFO_GET_ATTRIBUTE_FLOAT,
                                OrtStatus * (*)(const void *, const char *, float *))(info, "epsilon", &k.epsilon);
        if (absent) API(api, SLOT_RELEASE_STATUS, void (*)(OrtStatus *))(absent), k.epsilon = 1e-6f;
        if (!(k.epsilon >= 0.0f)) return error(api, ORT_INVALID_ARGUMENT, "litekv linear: epsilon must be >= 0");
    } else if (is_attention(op->kind)) {
        const int64_t heads = int_attribute(api, info, "num_heads", 0), kv_heads = int_attribute(api, info,
                                                                                                 "kv_num_heads", 0);
        const int64_t window = int_attribute(api, info, "local_window_size", -1);
        if (heads <= 0 || kv_heads <= 0 || heads % kv_heads || heads > 4096 || window == 0 || window > INT32_MAX)
            return error(api, ORT_INVALID_ARGUMENT, "litekv attention: num_heads and kv_num_heads must be "
                                                    "positive, num_heads a multiple of kv_num_heads, and "
                                                    "local_window_size positive or -1");
        OrtStatus *absent = API(api, SLOT_KERNEL_INFO_GET_ATTRIBUTE_FLOAT,
                                OrtStatus * (*)(const void *, const char *, float *))(info, "scale", &k.scale);
        if (absent) {
            API(api, SLOT_RELEASE_STATUS, void (*)(OrtStatus *))(absent);
            return error(api, ORT_INVALID_ARGUMENT, "litekv attention: the float attribute `scale` is missing");
        }
        const int64_t key_blocks = int_attribute(api, info, "key_blocks", 0);
        if (key_blocks != 0 && (key_blocks != 1 || !is_int8_attention(op->kind)))
            return error(api, ORT_INVALID_ARGUMENT, "litekv attention: key_blocks must be 0, or 1 on the Int8 ops");
        k.heads = (int)heads, k.kv_heads = (int)kv_heads, k.window = window < 0 ? 0 : (int)window;
        k.key_blocks = (int)key_blocks;
    }
    Kernel *made = malloc(sizeof(Kernel));
    if (!made) return error(api, ORT_FAIL, "litekv: out of memory");
    *made = k;
    *kernel = made;
    return NULL;
}

static void op_destroy_kernel(void *kernel) { free(kernel); }

/* ---- a call ---------------------------------------------------------------------------------- */

typedef struct {
    void *data;
    int64_t dims[MAX_RANK];
    size_t rank;
    size_t count;
} Tensor;

/* Input `index` (NULL data if absent and `optional`), of element type `type`. */
static OrtStatus *read_input(const OrtApi *api, void *context, size_t index, int type, int optional, Tensor *t) {
    const void *value = NULL;
    void *info = NULL;
    int element = 0;
    *t = (Tensor){0};
    CHECK(API(api, SLOT_KERNEL_CONTEXT_GET_INPUT, OrtStatus * (*)(void *, size_t, const void **))(context, index, &value));
    if (!value) return optional ? NULL : error(api, ORT_INVALID_ARGUMENT, "litekv: a required input is missing");
    CHECK(API(api, SLOT_GET_TENSOR_TYPE_AND_SHAPE, OrtStatus * (*)(const void *, void **))(value, &info));
    OrtStatus *status = API(api, SLOT_GET_TENSOR_ELEMENT_TYPE, OrtStatus * (*)(const void *, int *))(info, &element);
    if (!status) status = API(api, SLOT_GET_DIMENSIONS_COUNT, OrtStatus * (*)(const void *, size_t *))(info, &t->rank);
    if (!status && (t->rank == 0 || t->rank > MAX_RANK))
        status = error(api, ORT_INVALID_ARGUMENT, "litekv: an input's rank is 0 or above 8");
    if (!status)
        status = API(api, SLOT_GET_DIMENSIONS, OrtStatus * (*)(const void *, int64_t *, size_t))(info, t->dims, t->rank);
    API(api, SLOT_RELEASE_TENSOR_TYPE_AND_SHAPE_INFO, void (*)(void *))(info);
    if (status) return status;
    if (element != type) return error(api, ORT_INVALID_ARGUMENT, "litekv: an input has the wrong element type");
    t->count = 1;
    for (size_t i = 0; i < t->rank; i++) {
        if (t->dims[i] < 0 || t->dims[i] > INT32_MAX)
            return error(api, ORT_INVALID_ARGUMENT, "litekv: a dimension is out of range");
        t->count *= (size_t)t->dims[i];
    }
    return API(api, SLOT_GET_TENSOR_MUTABLE_DATA, OrtStatus * (*)(void *, void **))((void *)value, &t->data);
}

static OrtStatus *input(const OrtApi *api, void *context, size_t index, int type, Tensor *t) {
    return read_input(api, context, index, type, 0, t);
}

/* Output `index`, of shape dims[rank], made (or, bound by the caller, found) by ONNX Runtime. */
static OrtStatus *output(const OrtApi *api, void *context, size_t index, const int64_t *dims, size_t rank,
                         float **data) {
    void *value = NULL;
    CHECK(API(api, SLOT_KERNEL_CONTEXT_GET_OUTPUT, OrtStatus * (*)(void *, size_t, const int64_t *, size_t, void **))(
        context, index, dims, rank, &value));
    return API(api, SLOT_GET_TENSOR_MUTABLE_DATA, OrtStatus * (*)(void *, void **))(value, (void **)data);
}

/* At least `floats` floats of `s`, 64-byte aligned, or NULL if out of memory; under call_lock. */
static float *scratch(Scratch *s, size_t floats) {
    if (floats > s->floats) {
        free(s->data);
        s->data = aligned_alloc(64, (sizeof(float) * floats + 63) / 64 * 64);
        s->floats = s->data ? floats : 0;
    }
    return s->data;
}

/* A prefill chunk's attention tasks, taken in turn by the workers ONNX Runtime's pool runs. */
typedef struct {
    const PrefillJob *job;
    float *scratch[2];
    atomic_int next;
    int count;
} PrefillWork;

static void prefill_worker(void *data, size_t worker) {
    PrefillWork *work = data;
    for (int task; (task = atomic_fetch_add(&work->next, 1)) < work->count;)
        prefill_task(work->job, task, work->scratch[worker]);
}

/* The chunk's attention on ONNX Runtime's own threads (its prefill session has two): a helper
 * thread of litekv's would wait for the core that the pool's worker spins on between nodes. */
static OrtStatus *prefill_on_pool(const OrtApi *api, void *context, Registration *r, const PrefillJob *job) {
    const size_t floats = prefill_scratch_floats(job->heads, job->head_dim, job->slots);
    PrefillWork work = {job, {scratch(&r->prefill[0], floats), scratch(&r->prefill[1], floats)}, 0,
                        prefill_tasks(job)};
    if (!work.scratch[0] || !work.scratch[1]) return error(api, ORT_FAIL, "litekv attention: out of memory");
    return API(api, SLOT_KERNEL_CONTEXT_PARALLEL_FOR,
               OrtStatus * (*)(const void *, void (*)(void *, size_t), size_t, size_t, void *))(
        context, prefill_worker, 2, 2, &work);
}

/* LentThreads.run on ONNX Runtime's pool: the kernel's workers 0 and 1 as the pool's two tasks. */
typedef struct {
    const OrtApi *api;
    void *context;
} PoolOfCall;

static int run_on_pool(void *pool, void (*worker)(void *, size_t), void *data) {
    const PoolOfCall *call = pool;
    OrtStatus *status = API(call->api, SLOT_KERNEL_CONTEXT_PARALLEL_FOR,
                            OrtStatus * (*)(const void *, void (*)(void *, size_t), size_t, size_t, void *))(
        call->context, worker, 2, 2, data);
    if (!status) return 0;
    /* the kernel then computes what the pool left on this thread: the output is still whole */
    API(call->api, SLOT_RELEASE_STATUS, void (*)(OrtStatus *))(status);
    return 1;
}

/* sum = x + skip (skip NULL: x); normed = sum / sqrt(mean(sum^2) + epsilon) * weight, per row of `in`. */
/* (sum may be normed: the residual stream is not wanted.) In each ISA's clone, so the loops
 * vectorize (this file is built for the baseline ISA). */
VECTOR_CLONES static void rms_norm(const float *x, const float *skip, const float *weight, float epsilon, float *sum,
                                   float *normed, size_t tokens, size_t in) {
    for (size_t t = 0; t < tokens; t++) {
        const float *a = x + t * in, *b = skip ? skip + t * in : NULL;
        float *s = sum + t * in, *n = normed + t * in, squares = 0.0f;
        if (b)
            for (size_t i = 0; i < in; i++) s[i] = a[i] + b[i];
        else if (s != a)
            memcpy(s, a, sizeof(float) * in);
        for (size_t i = 0; i < in; i++) squares += s[i] * s[i];
        const float inverse = 1.0f / sqrtf(squares / (float)in + epsilon);
        for (size_t i = 0; i < in; i++) n[i] = s[i] * inverse * weight[i];
    }
}

static OrtStatus *linear_compute(const Kernel *kernel, void *context) {
    const Op *op = kernel->op;
    Registration *r = kernel->registration;
    const OrtApi *api = op->api;
    const int screened = op->kind == KIND_LINEAR_F32_SCREENED;
    const int int8 = op->kind == KIND_LINEAR_INT8, f32 = op->kind == KIND_LINEAR_F32 || screened, int4 = !int8 && !f32;
    const size_t weights = linear_weight_inputs(op->kind);
    Tensor x, codes, scales = {0}, offsets = {0}, row_scales = {0}, skip, norm_weight, screen = {0}, bounds = {0},
                     keep = {0};
    size_t inputs = 0, outputs = 0;
    CHECK(API(api, SLOT_KERNEL_CONTEXT_GET_INPUT_COUNT, OrtStatus * (*)(const void *, size_t *))(context, &inputs));
    CHECK(API(api, SLOT_KERNEL_CONTEXT_GET_OUTPUT_COUNT, OrtStatus * (*)(const void *, size_t *))(context, &outputs));
    if (inputs < weights || inputs > weights + 2 || outputs < 1 || outputs > 2)
        return error(api, ORT_INVALID_ARGUMENT, "litekv linear: wrong number of inputs or outputs");
    CHECK(input(api, context, 0, TYPE_FLOAT, &x));
    skip = norm_weight = (Tensor){0};
    if (inputs > weights) CHECK(read_input(api, context, weights, TYPE_FLOAT, 1, &skip));
    if (inputs > weights + 1) CHECK(read_input(api, context, weights + 1, TYPE_FLOAT, 1, &norm_weight));
    CHECK(input(api, context, 1, int8 ? TYPE_INT8 : f32 ? TYPE_FLOAT : TYPE_UINT8, &codes));
    if (!f32) CHECK(input(api, context, int8 ? 2 : 4, TYPE_FLOAT, &row_scales));
    if (int4) {
        CHECK(input(api, context, 2, TYPE_FLOAT16, &scales));
        CHECK(input(api, context, 3, TYPE_INT8, &offsets));
    }
    if (screened) {
        CHECK(input(api, context, 2, TYPE_INT8, &screen));
        CHECK(input(api, context, 3, TYPE_FLOAT, &row_scales));
        CHECK(input(api, context, 4, TYPE_FLOAT, &bounds));
        CHECK(input(api, context, 5, TYPE_INT32, &keep));
    }
    /* Every size checked against the others, so the kernel never reads past a buffer. */
    const size_t in = (size_t)x.dims[x.rank - 1], out = f32 ? (codes.rank ? (size_t)codes.dims[0] : 0) : row_scales.count;
    const size_t tokens = in ? x.count / in : 0, blocks = out && int4 ? scales.count / out : 0;
    const int shapes_agree =
        in > 0 && out > 0 && tokens > 0 && tokens <= INT32_MAX && (size_t)codes.dims[0] == out &&
        codes.count == (int4 ? out * in / 2 : out * in) && (kernel->gate == GATE_NONE || out % 2 == 0) &&
        (!int4 || (in % 2 == 0 && blocks > 0 && in % blocks == 0 && (in / blocks) % 2 == 0 &&
                   scales.count == out * blocks && offsets.count == out * blocks)) &&
        (!skip.data || (norm_weight.data && skip.count == x.count)) && (!norm_weight.data || norm_weight.count == in) &&
        (outputs == 1 || norm_weight.data) &&
        (!screened || (tokens == 1 && kernel->gate == GATE_NONE && screen.count == out * in &&
                       row_scales.count == out && bounds.count == out && keep.count == 1));
    if (!shapes_agree)
        return error(api, ORT_INVALID_ARGUMENT,
                     "litekv linear: the input shapes disagree (x [.., in], codes [out, ..] (LinearF32: the weight "
                     "[out, in]), scales [out, blocks], offsets [out, blocks], row scales [out]; an even out with a "
                     "gate; a norm's skip [.., in] only with its weight [in], and the sum output only with a norm; "
                     "LinearF32Screened: one row, the screen's codes [out, in], row scales and bounds [out], keep [1])");
    int64_t dims[MAX_RANK];
    for (size_t i = 0; i < x.rank; i++) dims[i] = x.dims[i];
    dims[x.rank - 1] = (int64_t)(kernel->gate ? out / 2 : out);
    float *y = NULL, *sum = NULL;
    CHECK(output(api, context, 0, dims, x.rank, &y));
    if (outputs == 2) CHECK(output(api, context, 1, x.dims, x.rank, &sum));
    pthread_mutex_lock(&call_lock);
    const float *activations = x.data;
    if (norm_weight.data) {
        float *normed = scratch(&r->normed, tokens * in);
        activations = normed;
        if (normed) rms_norm(x.data, skip.data, norm_weight.data, kernel->epsilon, sum ? sum : normed, normed, tokens,
                             in);
    }
    float *rows = kernel->gate ? scratch(&r->rows, tokens * out) : y;
    /* on_pool (set by the converter in graphs whose session has a pool of its own): the rows go to
     * that pool, whose worker spins between nodes; else to litekv's helper (the one-thread decode graph) */
    PoolOfCall call = {api, context};
    const LentThreads pool = {run_on_pool, &call};
    const int format = int8 ? LINEAR_INT8 : f32 ? LINEAR_F32 : LINEAR_UINT4;
    int status = !rows || !activations ? -1
                 : screened ? litekv_screened_head_run(op->config, activations, rows, codes.data, screen.data,
                                                       row_scales.data, bounds.data, *(const int32_t *)keep.data,
                                                       (int)in, (int)out, kernel->on_pool ? &pool : NULL, NULL)
                            : litekv_linear_run(op->config, format, activations, rows, codes.data, scales.data,
                                                offsets.data, row_scales.data, (int)tokens, (int)in, (int)out,
                                                int4 ? (int)(in / blocks) : 0, kernel->on_pool ? &pool : NULL);
    if (status == 0 && kernel->gate) linear_gate(rows, y, tokens, out / 2, kernel->gate);
    pthread_mutex_unlock(&call_lock);
    return status ? error(api, ORT_RUNTIME_EXCEPTION, "litekv linear: the kernel failed (out of memory?)") : NULL;
}

/* An Int4Offsets call's tasks (int4_offsets.c), taken in turn by the workers of ONNX Runtime's pool. */
typedef struct {
    const Int4Offsets *job;
    float *weights[2];
    atomic_int next;
    int count, tiles; /* tiles: tile tasks, else block-sum tasks */
} OffsetsWork;

static void offsets_worker(void *data, size_t worker) {
    OffsetsWork *work = data;
    for (int task; (task = atomic_fetch_add(&work->next, 1)) < work->count;) {
        if (work->tiles)
            int4_offsets_tile(work->job, task, work->weights[worker]);
        else
            int4_offsets_sums(work->job, task);
    }
}

static OrtStatus *offsets_compute(const Kernel *kernel, void *context) {
    const Op *op = kernel->op;
    Registration *r = kernel->registration;
    const OrtApi *api = op->api;
    Tensor y, x, offsets, scales;
    CHECK(input(api, context, 0, TYPE_FLOAT, &y));
    CHECK(input(api, context, 1, TYPE_FLOAT, &x));
    CHECK(input(api, context, 2, TYPE_INT8, &offsets));
    CHECK(input(api, context, 3, TYPE_FLOAT, &scales));
    const size_t in = (size_t)x.dims[x.rank - 1], out = (size_t)y.dims[y.rank - 1];
    const size_t blocks = offsets.rank == 2 ? (size_t)offsets.dims[1] : 0, tokens = in ? x.count / in : 0;
    int agree = x.rank == y.rank && in > 0 && out > 0 && tokens > 0 && tokens <= INT32_MAX && in <= INT32_MAX &&
                out <= INT32_MAX && y.count == tokens * out && offsets.rank == 2 && (size_t)offsets.dims[0] == out &&
                blocks > 0 && in % blocks == 0 && scales.count == out;
    for (size_t i = 0; agree && i + 1 < x.rank; i++) agree = x.dims[i] == y.dims[i];
    if (!agree)
        return error(api, ORT_INVALID_ARGUMENT, "litekv Int4Offsets: the input shapes disagree (y [.., out], x [.., "
                                                "in] with the same leading dimensions, offsets [out, blocks] with "
                                                "blocks dividing in, offset scales [out])");
    float *result = NULL;
    CHECK(output(api, context, 0, y.dims, y.rank, &result));
    pthread_mutex_lock(&call_lock);
    Int4Offsets job = {x.data, y.data, offsets.data, scales.data, scratch(&r->sums, tokens * blocks), result,
                       (int)tokens, (int)in, (int)out, (int)blocks};
    const size_t floats = int4_offsets_scratch_floats(&job);
    OffsetsWork work = {&job, {scratch(&r->offsets[0], floats), scratch(&r->offsets[1], floats)}, 0,
                        int4_offsets_sum_tasks(&job), 0};
    OrtStatus *status = NULL;
    if (!job.sums || !work.weights[0] || !work.weights[1]) status = error(api, ORT_FAIL, "litekv: out of memory");
    for (int tiles = 0; tiles < 2 && !status; tiles++) { /* every block sum before any tile reads them */
        if (tiles) work.tiles = 1, work.count = int4_offsets_tile_tasks(&job), atomic_store(&work.next, 0);
        status = API(api, SLOT_KERNEL_CONTEXT_PARALLEL_FOR,
                     OrtStatus * (*)(const void *, void (*)(void *, size_t), size_t, size_t, void *))(
            context, offsets_worker, 2, 2, &work);
    }
    pthread_mutex_unlock(&call_lock);
    return status;
}

/* codes = x / scale, rounded to the nearest (ties to even) and saturated, as GroupQueryAttention
 * writes an int8 cache. Saturated before rounding, and written so the loop vectorizes (a libm call
 * per element took 12 % of a 256-token int8 prefill chunk's attention). */
VECTOR_CLONES static void quantize(const float *restrict x, const float *restrict scale, int8_t *restrict codes,
                                   size_t count) {
    for (size_t i = 0; i < count; i++) {
        float q = x[i] / scale[i];
        q = q < -128.0f ? -128.0f : q;
        q = q > 127.0f ? 127.0f : q;
        codes[i] = (int8_t)(int)rintf(q);
    }
}

/* The values' static scales on a step's output [heads][head_dim] (head h reads KV head h / group):
 * the kernel weighed the codes. (A prefill chunk's kernel applies them as it writes its rows.) */
static void unscale_values(float *restrict out, const float *restrict scales, size_t heads, size_t group,
                           size_t head_dim) {
    for (size_t h = 0; h < heads; h++) {
        const float *restrict s = scales + h / group * head_dim;
        float *restrict o = out + h * head_dim;
        for (size_t i = 0; i < head_dim; i++) o[i] *= s[i];
    }
}

/* out = x * cos + rotate_half(x) * sin over the first 2 * half elements of a head; the rest copied. */
static void rotate(const float *restrict x, const float *restrict cos, const float *restrict sin, float *restrict out,
                   int half, int head_dim) {
    for (int i = 0; i < half; i++) {
        out[i] = x[i] * cos[i] - x[i + half] * sin[i];
        out[i + half] = x[i + half] * cos[i] + x[i] * sin[i];
    }
    memcpy(out + 2 * half, x + 2 * half, sizeof(float) * (size_t)(head_dim - 2 * half));
}

/* A query row as the kernels take it: RoPE (cos NULL: none), the attention scale and, for an int8
 * cache, the keys' scales (else NULL), so the kernels read the codes as they are. */
VECTOR_CLONES static void query_row(const float *restrict from, const float *cos, const float *sin, size_t half, size_t head_dim,
                      float scale, const float *restrict key_scales, float *restrict row) {
    if (cos)
        rotate(from, cos, sin, row, (int)half, (int)head_dim);
    else
        memcpy(row, from, sizeof(float) * head_dim);
    if (key_scales)
        for (size_t i = 0; i < head_dim; i++) row[i] = row[i] * scale * key_scales[i];
    else
        for (size_t i = 0; i < head_dim; i++) row[i] *= scale;
}

static OrtStatus *attention_compute(const Kernel *kernel, void *context) {
    const Op *op = kernel->op;
    const OrtApi *api = op->api;
    const int prefill = op->kind == KIND_PREFILL_ATTENTION || op->kind == KIND_PREFILL_ATTENTION_INT8;
    const int int8 = is_int8_attention(op->kind);
    const int cache_type = int8 ? TYPE_INT8 : TYPE_FLOAT;
    const size_t element = int8 ? 1 : sizeof(float);
    size_t inputs = 0;
    CHECK(API(api, SLOT_KERNEL_CONTEXT_GET_INPUT_COUNT, OrtStatus * (*)(const void *, size_t *))(context, &inputs));
    if (int8 ? inputs != ATTN_V_SCALE + 1 : inputs < ATTN_SEQLENS + 1 || inputs > ATTN_SIN + 1)
        return error(api, ORT_INVALID_ARGUMENT, "litekv attention: wrong number of inputs");
    Tensor q, k, v, past_k, past_v, seqlens, cos = {0}, sin = {0}, k_scale = {0}, v_scale = {0};
    CHECK(input(api, context, ATTN_QUERY, TYPE_FLOAT, &q));
    CHECK(read_input(api, context, ATTN_KEY, TYPE_FLOAT, 1, &k));
    CHECK(read_input(api, context, ATTN_VALUE, TYPE_FLOAT, 1, &v));
    CHECK(input(api, context, ATTN_PAST_KEY, cache_type, &past_k));
    CHECK(input(api, context, ATTN_PAST_VALUE, cache_type, &past_v));
    CHECK(input(api, context, ATTN_SEQLENS, TYPE_INT32, &seqlens));
    if (inputs > ATTN_COS) CHECK(read_input(api, context, ATTN_COS, TYPE_FLOAT, 1, &cos));
    if (inputs > ATTN_SIN) CHECK(read_input(api, context, ATTN_SIN, TYPE_FLOAT, 1, &sin));
    if (int8) {
        CHECK(input(api, context, ATTN_K_SCALE, TYPE_FLOAT, &k_scale));
        CHECK(input(api, context, ATTN_V_SCALE, TYPE_FLOAT, &v_scale));
    }
    const size_t heads = (size_t)kernel->heads, kv_heads = (size_t)kernel->kv_heads;
    const int packed = !k.data;
    /* Every size checked against the others, so nothing is read or written past a buffer. */
    int agree = past_k.rank == 4 && past_k.dims[0] == 1 && (size_t)past_k.dims[1] == kv_heads && past_k.dims[2] > 0 &&
                past_k.dims[3] > 0 && past_v.rank == 4 && past_v.count == past_k.count;
    for (size_t i = 0; agree && i < 4; i++) agree = past_v.dims[i] == past_k.dims[i];
    const size_t slots = agree ? (size_t)past_k.dims[2] : 0, head_dim = agree ? (size_t)past_k.dims[3] : 0;
    const size_t q_width = heads * head_dim, kv_width = kv_heads * head_dim;
    const size_t width = packed ? q_width + 2 * kv_width : q_width;
    const size_t tokens = agree ? q.count / width : 0;
    agree = agree && tokens > 0 && (prefill || tokens == 1) && !k.data == !v.data &&
            q.dims[q.rank - 1] == (int64_t)width && (packed || (k.count == tokens * kv_width &&
                                                                v.count == tokens * kv_width)) &&
            seqlens.count == 1 && !cos.data == !sin.data &&
            (!int8 || (k_scale.count == kv_width && v_scale.count == kv_width));
    const int rotary = cos.data != NULL;
    size_t half = 0;
    if (agree && rotary) {
        half = (size_t)cos.dims[cos.rank - 1];
        agree = cos.rank == 2 && sin.rank == 2 && cos.dims[0] == sin.dims[0] && cos.dims[1] == sin.dims[1] &&
                2 * half <= head_dim && half > 0;
    }
    if (!agree)
        return error(api, ORT_INVALID_ARGUMENT,
                     "litekv attention: the input shapes disagree (query [1, T, H*D] or packed [1, T, (H + 2 KVH) * "
                     "D] without key and value, key and value [1, T, KVH*D], T = 1 for DecodeAttention, past_key and "
                     "past_value [1, KVH, S, D], seqlens_k [1], cos and sin [P, R/2] with R <= D, both or neither; "
                     "int8 scales [1, KVH, 1, D])");
    /* seqlens_k is the last token's slot: the chunk sits right after the cache's tokens */
    const int64_t last = ((const int32_t *)seqlens.data)[0], first = last - (int64_t)tokens + 1;
    if (first < 0 || last >= (int64_t)slots || (rotary && last >= cos.dims[0]))
        return error(api, ORT_INVALID_ARGUMENT, "litekv attention: seqlens_k puts the tokens outside the cache (or "
                                                "the RoPE tables)");
    if (kernel->key_blocks && !key_blocks_fit(slots, (int)head_dim))
        return error(api, ORT_INVALID_ARGUMENT, "litekv attention: keys in blocks need a cache of a multiple of 8 "
                                                "slots and an even head_dim; reconvert the model");
    int64_t out_dims[MAX_RANK];
    for (size_t i = 0; i < q.rank; i++) out_dims[i] = q.dims[i];
    out_dims[q.rank - 1] = (int64_t)q_width;
    float *out = NULL;
    void *present_k = NULL, *present_v = NULL;
    CHECK(output(api, context, 0, out_dims, q.rank, &out));
    CHECK(output(api, context, 1, past_k.dims, 4, (float **)&present_k));
    CHECK(output(api, context, 2, past_v.dims, 4, (float **)&present_v));
    /* present bound apart from past: it starts as a copy (bound together, as litekv binds them,
     * nothing is copied) */
    if (present_k != past_k.data) memcpy(present_k, past_k.data, element * past_k.count);
    if (present_v != past_v.data) memcpy(present_v, past_v.data, element * past_v.count);
    const float *ks = k_scale.data, *vs = v_scale.data;
    const size_t group = heads / kv_heads;
    const size_t key_at = packed ? q_width : 0, value_at = packed ? q_width + kv_width : 0;
    const size_t q_stride = width, kv_stride = packed ? width : kv_width; /* floats from a token's row to the next */
    const float *keys = packed ? q.data : k.data, *values = packed ? q.data : v.data;
    pthread_mutex_lock(&call_lock);
    float *rotated = scratch(&kernel->registration->rows, tokens * q_width);
    int status = -1;
    if (rotated) {
        for (size_t t = 0; t < tokens; t++) {
            const size_t slot = (size_t)first + t;
            const float *cos_row = rotary ? (const float *)cos.data + slot * half : NULL,
                        *sin_row = rotary ? (const float *)sin.data + slot * half : NULL;
            for (size_t h = 0; h < heads; h++) /* an int8 cache's key scales folded into the query */
                query_row((const float *)q.data + t * q_stride + h * head_dim, cos_row, sin_row, half, head_dim,
                          kernel->scale, int8 ? ks + h / group * head_dim : NULL, rotated + t * q_width + h * head_dim);
            for (size_t kv = 0; kv < kv_heads; kv++) {
                const size_t at = (kv * slots + slot) * head_dim, from = t * kv_stride + kv * head_dim;
                float key[head_dim];
                if (rotary)
                    rotate(keys + key_at + from, cos_row, sin_row, key, (int)half, (int)head_dim);
                else
                    memcpy(key, keys + key_at + from, sizeof(float) * head_dim);
                if (int8) {
                    if (kernel->key_blocks) { /* the row's codes, then each pair to its place in the block */
                        int8_t codes[head_dim];
                        quantize(key, ks + kv * head_dim, codes, head_dim);
                        block_keys((int8_t *)present_k + kv * slots * head_dim, codes, head_dim, slots * head_dim,
                                   (int)head_dim, 1, (int)slot, (int)slot, head_dim);
                    } else {
                        quantize(key, ks + kv * head_dim, (int8_t *)present_k + at, head_dim);
                    }
                    quantize(values + value_at + from, vs + kv * head_dim, (int8_t *)present_v + at, head_dim);
                } else {
                    memcpy((float *)present_k + at, key, sizeof(float) * head_dim);
                    memcpy((float *)present_v + at, values + value_at + from, sizeof(float) * head_dim);
                }
            }
        }
        if (tokens == 1) {
            /* DecodeAttention lives in a step graph whose session has one thread and whose other
             * ops (litekv's linears) share work with the kernel's helper thread; PrefillAttention in
             * a session with a pool of its own, whose worker spins between nodes: its one-token
             * calls take that worker, not the helper, which would wait for the core it holds. */
            PoolOfCall call = {api, context};
            const LentThreads pool = {run_on_pool, &call};
            const int64_t lo = kernel->window ? last - kernel->window + 1 : 0;
            status = litekv_attention_head_major(op->config, rotated, present_k, present_v, out, (int)heads,
                                                 (int)kv_heads, (int)slots, (int)head_dim, lo > 0 ? (int)lo : 0,
                                                 (int)last, (int8 ? CACHE_I8 : CACHE_F32) |
                                                                (kernel->key_blocks ? CACHE_KEY_BLOCKS : 0),
                                                 prefill ? &pool : NULL);
            if (int8 && status == 0) unscale_values(out, vs, heads, group, head_dim);
        } else {
            PrefillJob job = {rotated, NULL, present_k, present_v, NULL, NULL, out, int8 ? CACHE_I8 : CACHE_F32,
                              (int)tokens, (int)slots, (int)heads, (int)kv_heads, (int)head_dim,
                              (int)head_dim, slots * head_dim, (int)first, kernel->window, int8 ? vs : NULL};
            OrtStatus *pooled = NULL;
            if (kernel->key_blocks) { /* the prefill kernel reads rows: slots 0..last, once for the chunk */
                const size_t bytes = slots * kv_heads * head_dim;
                int8_t *rows = (int8_t *)scratch(&kernel->registration->key_rows, (bytes + 3) / 4);
                if (rows)
                    unblock_keys(rows, present_k, head_dim, slots * head_dim, (int)head_dim, (int)kv_heads, 0,
                                 (int)last);
                else
                    pooled = error(api, ORT_FAIL, "litekv attention: out of memory");
                job.keys = rows;
            }
            if (!pooled) pooled = prefill_on_pool(api, context, kernel->registration, &job);
            pthread_mutex_unlock(&call_lock);
            return pooled;
        }
    }
    pthread_mutex_unlock(&call_lock);
    return status ? error(api, ORT_RUNTIME_EXCEPTION,
                          "litekv attention: the kernel refused the call (a head_dim or cache longer than the bundle's, "
                          "or out of memory)")
                  : NULL;
}

/* Gate: y [.., h] = act(x [.., :h]) * x [.., h:], a gated MLP's activation over a projection of
 * ONNX Runtime's own (LinearInt4 does it inside): one node in place of a split, the activation and
 * a product, each costing ONNX Runtime a node. A prefill chunk's rows are halved between the two
 * workers of the session's pool. */
typedef struct {
    const float *x;
    float *y;
    size_t tokens, half;
    int gate;
} GateWork;

static void gate_worker(void *data, size_t worker) {
    const GateWork *w = data;
    const size_t first = w->tokens * worker / 2, last = w->tokens * (worker + 1) / 2;
    linear_gate(w->x + 2 * w->half * first, w->y + w->half * first, last - first, w->half, w->gate);
}

static OrtStatus *gate_compute(const Kernel *kernel, void *context) {
    const OrtApi *api = kernel->op->api;
    Tensor x;
    CHECK(input(api, context, 0, TYPE_FLOAT, &x));
    const size_t width = x.rank ? (size_t)x.dims[x.rank - 1] : 0;
    if (width == 0 || width % 2)
        return error(api, ORT_INVALID_ARGUMENT, "litekv Gate: the input's last dimension must be even: [.., 2 h]");
    int64_t dims[MAX_RANK];
    for (size_t i = 0; i < x.rank; i++) dims[i] = x.dims[i];
    dims[x.rank - 1] = (int64_t)(width / 2);
    float *y = NULL;
    CHECK(output(api, context, 0, dims, x.rank, &y));
    GateWork work = {x.data, y, x.count / width, width / 2, kernel->gate};
    if (work.tokens == 1) {
        gate_worker(&work, 0), gate_worker(&work, 1);
        return NULL;
    }
    return API(api, SLOT_KERNEL_CONTEXT_PARALLEL_FOR,
               OrtStatus * (*)(const void *, void (*)(void *, size_t), size_t, size_t, void *))(context, gate_worker, 2,
                                                                                              2, &work);
}

static OrtStatus *op_compute(void *kernel_data, void *context) {
    const Kernel *kernel = kernel_data;
    const int kind = kernel->op->kind;
    return is_attention(kind)           ? attention_compute(kernel, context)
           : kind == KIND_INT4_OFFSETS ? offsets_compute(kernel, context)
           : kind == KIND_GATE         ? gate_compute(kernel, context)
                                       : linear_compute(kernel, context);
}

/* ---- registration ---------------------------------------------------------------------------- */

static void describe(Op *op, Registration *r, void *config, int kind) {
    *op = (Op){
        .op = {.version = ORT_API_VERSION_USED, .GetName = op_name, .GetExecutionProviderType = op_provider,
               .GetInputType = op_input_type, .GetInputTypeCount = op_input_count, .GetOutputType = op_output_type,
               .GetOutputTypeCount = op_output_count, .KernelDestroy = op_destroy_kernel,
               .GetInputCharacteristic = op_input_characteristic, .GetOutputCharacteristic = op_output_characteristic,
               .GetInputMemoryType = op_memory_type, .CreateKernelV2 = op_create_kernel,
               .KernelComputeV2 = op_compute},
        .api = r->api, .config = config, .registration = r, .kind = kind};
}

/* The AttentionConfig the next RegisterCustomOps binds its ops to. */
void litekv_ort_prepare(void *config) { atomic_store(&pending_config, config); }

/* The registration RegisterCustomOps made last (NULL if none), now the caller's to release. */
void *litekv_ort_take(void) { return atomic_exchange(&last_registration, NULL); }

/* Frees a registration; only after every session made with its options is destroyed. */
void litekv_ort_release(void *registration) {
    Registration *r = registration;
    if (!r) return;
    if (r->domain) API(r->api, SLOT_RELEASE_CUSTOM_OP_DOMAIN, void (*)(void *))(r->domain);
    free(r->rows.data), free(r->normed.data), free(r->prefill[0].data), free(r->prefill[1].data);
    free(r->sums.data), free(r->offsets[0].data), free(r->offsets[1].data), free(r->key_rows.data);
    free(r);
}

/* Called by ONNX Runtime from SessionOptions.register_custom_ops_library(this library's path). */
__attribute__((visibility("default"))) OrtStatus *RegisterCustomOps(void *options, const OrtApiBase *base) {
    const OrtApi *api = base->GetApi(ORT_API_VERSION_USED);
    if (!api) return NULL; /* an ONNX Runtime before 1.16 cannot even report the error; litekv requires a later one */
    void *config = atomic_exchange(&pending_config, NULL);
    if (!config)
        return error(api, ORT_FAIL, "litekv's custom ops are registered through litekv (its ONNX executor), "
                                    "not by the library's path alone");
    Registration *r = calloc(1, sizeof(Registration));
    if (!r) return error(api, ORT_FAIL, "litekv: out of memory");
    r->api = api;
    OrtStatus *status =
        API(api, SLOT_CREATE_CUSTOM_OP_DOMAIN, OrtStatus * (*)(const char *, void **))("litekv", &r->domain);
    for (int kind = 0; kind < KINDS && !status; kind++) {
        describe(&r->ops[kind], r, config, kind);
        status = API(api, SLOT_CUSTOM_OP_DOMAIN_ADD, OrtStatus * (*)(void *, const void *))(r->domain, &r->ops[kind]);
    }
    if (!status) status = API(api, SLOT_ADD_CUSTOM_OP_DOMAIN, OrtStatus * (*)(void *, void *))(options, r->domain);
    if (status) {
        litekv_ort_release(r);
        return status;
    }
    atomic_store(&last_registration, r); /* litekv takes it at once; one it never took is left, not freed */
    return NULL;
}
