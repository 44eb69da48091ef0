// measure.hpp — the machine's memory bandwidth, measured the way decode reads weights: every thread of the pool streams
// through its own contiguous share of a buffer far larger than the caches, once, and sums what it reads. Chapter 04
// and bench_decode divide decode's achieved bytes per second by this figure: the ceiling a memory-bound step can reach.
#pragma once

#include "infer.hpp"

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

namespace measure {

struct Bandwidth {
    double bytes_per_second = 0;  // the best pass
    size_t buffer_bytes = 0;
    int passes = 0;
    int threads = 0;
};

// Reads `buffer_bytes` (default 1 GiB: 30× a 32 MiB L3, so no pass is served from cache) `passes` times and keeps the
// fastest pass: slower ones lost time to something else running, not to the memory system.
inline Bandwidth memory_bandwidth(infer::ThreadPool& pool, size_t buffer_bytes = size_t{1} << 30, int passes = 10) {
    const size_t words = buffer_bytes / 64 * 8;  // whole cache lines
    // Not std::vector: it would zero the buffer from this thread alone. Each thread touches its own share first, so
    // the pages are really allocated (an untouched page reads as the shared zero page, which sits in cache) and, on a
    // multi-socket machine, live next to the thread that reads them.
    std::unique_ptr<uint64_t[]> buffer(new uint64_t[words]);
    pool.run(words, [&](size_t begin, size_t end, int) {
        for (size_t i = begin; i < end; ++i) buffer[i] = 0x3F8000003F800000ull;  // two floats of 1.0: no denormals to slow the adds
    });

    Bandwidth result{0, words * sizeof(uint64_t), passes, pool.size()};
    std::vector<uint64_t> sums(static_cast<size_t>(pool.size()));
    for (int pass = 0; pass < passes; ++pass) {
        infer::Stopwatch clock;
        // Work is handed out in 64-byte cache lines, so each thread's share is whole lines and needs no tail loop.
        pool.run(words / 8, [&](size_t begin, size_t end, int thread) {
            // Sixteen float lanes, the shape of the matmul kernel's loop without its multiply: the compiler turns
            // them into vector registers, so the loop issues loads as fast as the core can and times the memory.
            const float* line = reinterpret_cast<const float*>(buffer.get() + begin * 8);
            float lanes[16] = {};
            for (size_t n = begin; n < end; ++n, line += 16)
                for (int lane = 0; lane < 16; ++lane) lanes[lane] += line[lane];
            uint64_t sum = 0;
            for (float lane : lanes) sum += static_cast<uint64_t>(lane != 0);
            sums[static_cast<size_t>(thread)] = sum;
        });
        double seconds = clock.seconds();
        result.bytes_per_second = std::max(result.bytes_per_second, static_cast<double>(result.buffer_bytes) / seconds);
    }
    // The sums are the reads' only use: publish them through a volatile, so the optimizer cannot drop the loop.
    volatile uint64_t sink = 0;
    for (uint64_t s : sums) sink = sink + s;
    return result;
}

}  // namespace measure
