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
 * The library is the one Python loads with ctypes: litekv_ort_prepare() names the AttentionConfig
 * the next registration uses, then SessionOptions.register_custom_ops_library(path) calls
 * RegisterCustomOps, and litekv_ort_take() hands the registration back, for litekv_ort_release()
 * once every session using it is gone. ONNX Runtime's headers are not needed: the few entry points
 * used are addressed by their slot in OrtApi, which only ever grows at its end (API version 16). */
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

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
    SLOT_KERNEL_INFO_GET_ATTRIBUTE_INT64 = 86,
    SLOT_KERNEL_CONTEXT_GET_INPUT_COUNT = 88,
    SLOT_KERNEL_CONTEXT_GET_INPUT = 90,
    SLOT_KERNEL_CONTEXT_GET_OUTPUT = 91,
    SLOT_RELEASE_STATUS = 93,
    SLOT_RELEASE_TENSOR_TYPE_AND_SHAPE_INFO = 99,
    SLOT_RELEASE_CUSTOM_OP_DOMAIN = 101,
};
#define API(api, slot, type) ((type)((void *const *)(const void *)(api))[slot])

enum { ORT_FAIL = 1, ORT_INVALID_ARGUMENT = 2, ORT_RUNTIME_EXCEPTION = 6 };
enum { TYPE_FLOAT = 1, TYPE_UINT8 = 2, TYPE_INT8 = 3, TYPE_FLOAT16 = 10 };
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
                      const int8_t *offsets, const float *row_scales, int tokens, int in, int out, int block);

/* One op of one registration: ONNX Runtime hands `op` back to every callback, so the rest is ours. */
typedef struct {
    CustomOp op;
    const OrtApi *api;
    void *config; /* the AttentionConfig whose state (scratch, helper thread) runs the linears */
    struct Registration *registration;
    int format;
} LinearOp;

typedef struct Registration {
    LinearOp int4, int8;
    const OrtApi *api;
    void *domain;
    float *gate_scratch; /* a gated call's rows before the gate, under call_lock, grown to the widest */
    size_t gate_scratch_floats;
} Registration;

/* One node's kernel: its op and its gate. */
typedef struct {
    const LinearOp *op;
    Registration *registration;
    int gate;
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

/* ---- the op's description ---------------------------------------------------------------------- */

static const char *op_name(const CustomOp *op) {
    return ((const LinearOp *)(const void *)op)->format == LINEAR_INT8 ? "LinearInt8" : "LinearInt4";
}

static const char *op_provider(const CustomOp *op) {
    (void)op;
    return NULL; /* the CPU execution provider */
}

static size_t op_input_count(const CustomOp *op) {
    return ((const LinearOp *)(const void *)op)->format == LINEAR_INT8 ? 3 : 5;
}

static int op_input_type(const CustomOp *op, size_t index) {
    static const int int4[] = {TYPE_FLOAT, TYPE_UINT8, TYPE_FLOAT16, TYPE_INT8, TYPE_FLOAT};
    static const int int8[] = {TYPE_FLOAT, TYPE_INT8, TYPE_FLOAT};
    const int is_int8 = ((const LinearOp *)(const void *)op)->format == LINEAR_INT8;
    if (index >= op_input_count(op)) return 0;
    return is_int8 ? int8[index] : int4[index];
}

static size_t op_output_count(const CustomOp *op) {
    (void)op;
    return 1;
}

static int op_output_type(const CustomOp *op, size_t index) {
    (void)op;
    (void)index;
    return TYPE_FLOAT;
}

static int op_required(const CustomOp *op, size_t index) {
    (void)op;
    (void)index;
    return 0; /* INPUT_OUTPUT_REQUIRED */
}

static int op_memory_type(const CustomOp *op, size_t index) {
    (void)op;
    (void)index;
    return 0; /* OrtMemTypeDefault */
}

static OrtStatus *op_create_kernel(const CustomOp *custom, const OrtApi *api, const void *info, void **kernel) {
    const LinearOp *op = (const LinearOp *)(const void *)custom;
    int64_t gate = GATE_NONE;
    if (op->format != LINEAR_INT8) {
        OrtStatus *absent = API(api, SLOT_KERNEL_INFO_GET_ATTRIBUTE_INT64, OrtStatus * (*)(const void *, const char *,
                                                                                          int64_t *))(info, "gate", &gate);
        if (absent) API(api, SLOT_RELEASE_STATUS, void (*)(OrtStatus *))(absent), gate = GATE_NONE;
    }
    if (gate != GATE_NONE && gate != GATE_SILU && gate != GATE_GELU_TANH)
        return error(api, ORT_INVALID_ARGUMENT, "litekv linear: unknown gate (1 = silu, 2 = gelu_tanh)");
    Kernel *k = malloc(sizeof(Kernel));
    if (!k) return error(api, ORT_FAIL, "litekv linear: out of memory");
    *k = (Kernel){op, op->registration, (int)gate};
    *kernel = k;
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

static OrtStatus *input(const OrtApi *api, void *context, size_t index, int type, Tensor *t) {
    const void *value = NULL;
    void *info = NULL;
    int element = 0;
    CHECK(API(api, SLOT_KERNEL_CONTEXT_GET_INPUT, OrtStatus * (*)(void *, size_t, const void **))(context, index, &value));
    if (!value) return error(api, ORT_INVALID_ARGUMENT, "litekv linear: an input is missing");
    CHECK(API(api, SLOT_GET_TENSOR_TYPE_AND_SHAPE, OrtStatus * (*)(const void *, void **))(value, &info));
    OrtStatus *status = API(api, SLOT_GET_TENSOR_ELEMENT_TYPE, OrtStatus * (*)(const void *, int *))(info, &element);
    if (!status) status = API(api, SLOT_GET_DIMENSIONS_COUNT, OrtStatus * (*)(const void *, size_t *))(info, &t->rank);
    if (!status && (t->rank == 0 || t->rank > MAX_RANK))
        status = error(api, ORT_INVALID_ARGUMENT, "litekv linear: an input's rank is 0 or above 8");
    if (!status)
        status = API(api, SLOT_GET_DIMENSIONS, OrtStatus * (*)(const void *, int64_t *, size_t))(info, t->dims, t->rank);
    API(api, SLOT_RELEASE_TENSOR_TYPE_AND_SHAPE_INFO, void (*)(void *))(info);
    if (status) return status;
    if (element != type) return error(api, ORT_INVALID_ARGUMENT, "litekv linear: an input has the wrong element type");
    t->count = 1;
    for (size_t i = 0; i < t->rank; i++) {
        if (t->dims[i] < 0 || t->dims[i] > INT32_MAX)
            return error(api, ORT_INVALID_ARGUMENT, "litekv linear: a dimension is out of range");
        t->count *= (size_t)t->dims[i];
    }
    return API(api, SLOT_GET_TENSOR_MUTABLE_DATA, OrtStatus * (*)(void *, void **))((void *)value, &t->data);
}

static OrtStatus *op_compute(void *kernel_data, void *context) {
    const Kernel *kernel = kernel_data;
    const LinearOp *op = kernel->op;
    Registration *r = kernel->registration;
    const OrtApi *api = op->api;
    const int int8 = op->format == LINEAR_INT8;
    size_t inputs = 0;
    CHECK(API(api, SLOT_KERNEL_CONTEXT_GET_INPUT_COUNT, OrtStatus * (*)(const void *, size_t *))(context, &inputs));
    if (inputs != (int8 ? 3u : 5u)) return error(api, ORT_INVALID_ARGUMENT, "litekv linear: wrong number of inputs");
    Tensor x, codes, scales = {0}, offsets = {0}, row_scales;
    CHECK(input(api, context, 0, TYPE_FLOAT, &x));
    CHECK(input(api, context, 1, int8 ? TYPE_INT8 : TYPE_UINT8, &codes));
    CHECK(input(api, context, int8 ? 2 : 4, TYPE_FLOAT, &row_scales));
    if (!int8) {
        CHECK(input(api, context, 2, TYPE_FLOAT16, &scales));
        CHECK(input(api, context, 3, TYPE_INT8, &offsets));
    }
    /* Every size checked against the others, so the kernel never reads past a buffer. */
    const size_t in = (size_t)x.dims[x.rank - 1], out = row_scales.count;
    const size_t tokens = in ? x.count / in : 0, blocks = out && !int8 ? scales.count / out : 0;
    const int shapes_agree =
        in > 0 && out > 0 && tokens > 0 && tokens <= INT32_MAX && (size_t)codes.dims[0] == out &&
        codes.count == (int8 ? out * in : out * in / 2) && (kernel->gate == GATE_NONE || out % 2 == 0) &&
        (int8 || (in % 2 == 0 && blocks > 0 && in % blocks == 0 && (in / blocks) % 2 == 0 &&
                  scales.count == out * blocks && offsets.count == out * blocks));
    if (!shapes_agree)
        return error(api, ORT_INVALID_ARGUMENT,
                     "litekv linear: the input shapes disagree (x [.., in], codes [out, ..], scales [out, blocks], "
                     "offsets [out, blocks], row scales [out]; an even out with a gate)");
    int64_t dims[MAX_RANK];
    for (size_t i = 0; i < x.rank; i++) dims[i] = x.dims[i];
    dims[x.rank - 1] = (int64_t)(kernel->gate ? out / 2 : out);
    void *y_value = NULL;
    float *y = NULL;
    CHECK(API(api, SLOT_KERNEL_CONTEXT_GET_OUTPUT, OrtStatus * (*)(void *, size_t, const int64_t *, size_t, void **))(
        context, 0, dims, x.rank, &y_value));
    CHECK(API(api, SLOT_GET_TENSOR_MUTABLE_DATA, OrtStatus * (*)(void *, void **))(y_value, (void **)&y));
    pthread_mutex_lock(&call_lock);
    float *rows = y;
    if (kernel->gate && tokens * out > r->gate_scratch_floats) { /* once per model: the widest gated call */
        free(r->gate_scratch);
        r->gate_scratch = malloc(sizeof(float) * tokens * out);
        r->gate_scratch_floats = r->gate_scratch ? tokens * out : 0;
    }
    if (kernel->gate) rows = r->gate_scratch;
    int status = rows ? litekv_linear_run(op->config, op->format, x.data, rows, codes.data, scales.data, offsets.data,
                                          row_scales.data, (int)tokens, (int)in, (int)out,
                                          int8 ? 0 : (int)(in / blocks))
                      : -1;
    if (status == 0 && kernel->gate) linear_gate(rows, y, tokens, out / 2, kernel->gate);
    pthread_mutex_unlock(&call_lock);
    return status ? error(api, ORT_RUNTIME_EXCEPTION, "litekv linear: the kernel failed (out of memory?)") : NULL;
}

/* ---- registration ---------------------------------------------------------------------------- */

static void describe(LinearOp *op, Registration *r, void *config, int format) {
    *op = (LinearOp){
        .op = {.version = ORT_API_VERSION_USED, .GetName = op_name, .GetExecutionProviderType = op_provider,
               .GetInputType = op_input_type, .GetInputTypeCount = op_input_count, .GetOutputType = op_output_type,
               .GetOutputTypeCount = op_output_count, .KernelDestroy = op_destroy_kernel,
               .GetInputCharacteristic = op_required, .GetOutputCharacteristic = op_required,
               .GetInputMemoryType = op_memory_type, .CreateKernelV2 = op_create_kernel,
               .KernelComputeV2 = op_compute},
        .api = r->api, .config = config, .registration = r, .format = format};
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
    free(r->gate_scratch);
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
    if (!r) return error(api, ORT_FAIL, "litekv linear: out of memory");
    r->api = api;
    describe(&r->int4, r, config, LINEAR_UINT4);
    describe(&r->int8, r, config, LINEAR_INT8);
    OrtStatus *status =
        API(api, SLOT_CREATE_CUSTOM_OP_DOMAIN, OrtStatus * (*)(const char *, void **))("litekv", &r->domain);
    if (!status) status = API(api, SLOT_CUSTOM_OP_DOMAIN_ADD, OrtStatus * (*)(void *, const void *))(r->domain, &r->int4);
    if (!status) status = API(api, SLOT_CUSTOM_OP_DOMAIN_ADD, OrtStatus * (*)(void *, const void *))(r->domain, &r->int8);
    if (!status) status = API(api, SLOT_ADD_CUSTOM_OP_DOMAIN, OrtStatus * (*)(void *, void *))(options, r->domain);
    if (status) {
        litekv_ort_release(r);
        return status;
    }
    atomic_store(&last_registration, r); /* litekv takes it at once; one it never took is left, not freed */
    return NULL;
}
