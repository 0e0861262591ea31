/* A stand-in for libcuda.so.1, for `spillover stress gpu` on machines with no NVIDIA
 * card: one card whose free memory is CUDA_STANDIN_FREE_MIB (of CUDA_STANDIN_TOTAL_MIB),
 * a primary context that takes CUDA_STANDIN_CONTEXT_MIB of it, and allocations refused
 * with CUDA_ERROR_OUT_OF_MEMORY beyond what is free, as the driver refuses them. Only the
 * calls scripts/stress.py and scripts/parts/cardorder.py make. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MIB (1024ULL * 1024ULL)
#define OUT_OF_MEMORY 2
#define BLOCKS 64

static uint64_t free_bytes, total_bytes;
static uint64_t sizes[BLOCKS];

static uint64_t mib_from(const char *name, uint64_t otherwise) {
    const char *value = getenv(name);
    return (value ? strtoull(value, NULL, 10) : otherwise) * MIB;
}

int cuInit(unsigned int flags) {
    (void)flags;
    free_bytes = mib_from("CUDA_STANDIN_FREE_MIB", 500);
    total_bytes = mib_from("CUDA_STANDIN_TOTAL_MIB", 24576);
    return 0;
}

int cuDeviceGetCount(int *count) { *count = 1; return 0; }
int cuDeviceGet(int *device, int ordinal) { *device = ordinal; return ordinal == 0 ? 0 : 101; }

int cuDeviceGetPCIBusId(char *text, int length, int device) {
    (void)device;
    strncpy(text, "0000:17:00.0", (size_t)length);
    return 0;
}

int cuDevicePrimaryCtxRetain(void **context, int device) {
    (void)device;
    uint64_t needs = mib_from("CUDA_STANDIN_CONTEXT_MIB", 0);
    if (needs > free_bytes) return OUT_OF_MEMORY;
    free_bytes -= needs;
    *context = (void *)1;
    return 0;
}

int cuDevicePrimaryCtxRelease(int device) { (void)device; return 0; }
int cuCtxSetCurrent(void *context) { (void)context; return 0; }
int cuCtxSynchronize(void) { return 0; }

int cuMemAlloc_v2(uint64_t *pointer, size_t bytes) {
    if (bytes > free_bytes) return OUT_OF_MEMORY;
    for (int block = 0; block < BLOCKS; block++) {
        if (sizes[block] == 0) {
            sizes[block] = bytes;
            free_bytes -= bytes;
            *pointer = (uint64_t)(block + 1);
            return 0;
        }
    }
    return OUT_OF_MEMORY;
}

int cuMemFree_v2(uint64_t pointer) {
    if (pointer == 0 || pointer > BLOCKS) return 1;
    free_bytes += sizes[pointer - 1];
    sizes[pointer - 1] = 0;
    return 0;
}

int cuMemsetD8_v2(uint64_t pointer, unsigned char value, size_t bytes) {
    (void)value;
    return pointer >= 1 && pointer <= BLOCKS && bytes <= sizes[pointer - 1] ? 0 : 1;
}

int cuMemGetInfo_v2(size_t *free, size_t *total) {
    *free = free_bytes;
    *total = total_bytes;
    return 0;
}

int cuGetErrorName(int error, const char **name) {
    *name = error == OUT_OF_MEMORY ? "CUDA_ERROR_OUT_OF_MEMORY" : "CUDA_ERROR_UNKNOWN";
    return 0;
}
