/* An fp32 LM head's likely rows, exact, from a quarter of its bytes (linear.h, ScreenedHead).
 *
 * In-graph samplers draw from the `keep` most likely tokens, so a step needs those rows of the
 * head exactly and no others. The int8 screen bounds every row: the keep-th largest lower bound is a
 * threshold that each of the true top `keep` rows reaches with its upper bound, so computing the rows
 * that reach it (a few hundred of SmolLM2's 49,152) from the fp32 weights gives the top `keep`
 * as the whole head would, to the bit. */
#include "linear.h"

#include <float.h>
#include <math.h>

static void sift_down(float *heap, int n, int i) {
    for (;;) {
        int child = 2 * i + 1;
        if (child >= n) return;
        if (child + 1 < n && heap[child + 1] < heap[child]) child++;
        if (heap[i] <= heap[child]) return;
        const float swap = heap[i];
        heap[i] = heap[child], heap[child] = swap;
        i = child;
    }
}

static void sift_up(float *heap, int i) {
    while (i > 0 && heap[(i - 1) / 2] > heap[i]) {
        const int parent = (i - 1) / 2;
        const float swap = heap[i];
        heap[i] = heap[parent], heap[parent] = swap;
        i = parent;
    }
}

int screened_head_finish(const ScreenedHead *head, float *heap) {
    const LinearJob *exact = head->exact;
    const int out = exact->out, keep = head->keep;
    if (exact->format != LINEAR_F32 || exact->tokens != 1 || exact->rows_per_task != 1 || keep < 1 || keep > out)
        return -1;
    double squares = 0.0;
    for (int k = 0; k < exact->in; k++) squares += (double)exact->x[k] * exact->x[k];
    const float norm = (float)sqrt(squares) * (1.0f + 0x1p-16f); /* rounded up: the bounds stay bounds */
    float *y = exact->y;
    /* the keep largest lower bounds, smallest at heap[0] */
    int size = 0;
    for (int r = 0; r < out; r++) {
        float low = y[r] - head->bounds[r] * norm;
        if (low != low) low = -INFINITY; /* NaN: never the threshold (its row is recomputed below) */
        if (size < keep) {
            heap[size] = low;
            sift_up(heap, size++);
        } else if (low > heap[0]) {
            heap[0] = low;
            sift_down(heap, keep, 0);
        }
    }
    const float threshold = heap[0];
    int computed = 0;
    for (int r = 0; r < out; r++) {
        if (!(y[r] + head->bounds[r] * norm < threshold)) { /* a NaN recomputes: the head's NaN stays */
            linear_task(exact, r); /* y[r] from W's row */
            computed++;
        } else {
            y[r] = -FLT_MAX;
        }
    }
    return computed;
}
