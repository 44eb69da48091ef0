// The deterministic fuzz run of every `meson test`: each target of fuzz_targets.hpp meets a few hundred mutations of
// its seeds, from a fixed random seed, so a failure reproduces exactly. Mutations are the kinds that break parsers:
// bit flips, bytes set to interesting values (0, 0xFF, 0x80), 32- and 64-bit fields overwritten with edge integers
// (0, -1, INT32_MIN, 2^31, 2^62, 2^64-1), truncations, duplicated and deleted ranges, and splices of two seeds. Every
// case must end normally or with an infer::Error; a crash fails the suite, and any other exception is reported with the
// target, seed and case that produced it. Longer coverage-guided runs: scripts/fuzz.sh (libFuzzer).
#include "support.hpp"

#include "fuzz_targets.hpp"

#include <random>

namespace {

using fuzz::Bytes;

// One mutation of `input`, drawn from `rng`; `other` is a second seed for splices. Binary formats keep their bulk
// (the weights) but have their headers and tables mutated: edits land in the first 4 KB three times out of four.
Bytes mutate(Bytes input, const Bytes& other, std::mt19937_64& rng) {
    auto pick = [&](size_t n) { return n == 0 ? size_t{0} : static_cast<size_t>(rng() % n); };
    auto position = [&] { return pick(rng() % 4 != 0 ? std::min<size_t>(input.size(), 4096) : input.size()); };
    static const uint64_t edges[] = {0, 1, 0xFF, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 1ull << 62, ~0ull, 0x8000000000000000ull};
    const int edits = 1 + static_cast<int>(rng() % 4);
    for (int e = 0; e < edits && !input.empty(); ++e) {
        switch (rng() % 7) {
            case 0: input[position()] ^= static_cast<uint8_t>(1u << (rng() % 8)); break;
            case 1: input[position()] = static_cast<uint8_t>(std::array<int, 5>{0, 0xFF, 0x80, '"', '{'}[rng() % 5]); break;
            case 2: {  // an edge integer over a 4- or 8-byte field
                const size_t width = rng() % 2 ? 4 : 8;
                const size_t at = position();
                const uint64_t value = edges[rng() % std::size(edges)];
                for (size_t i = 0; i < width && at + i < input.size(); ++i) input[at + i] = static_cast<uint8_t>(value >> (8 * i));
                break;
            }
            case 3: input.resize(pick(input.size())); break;  // truncation
            case 4: {  // duplicate a range
                const size_t at = position(), length = std::min<size_t>(pick(64) + 1, input.size() - at);
                Bytes copy(input.begin() + static_cast<std::ptrdiff_t>(at), input.begin() + static_cast<std::ptrdiff_t>(at + length));
                input.insert(input.begin() + static_cast<std::ptrdiff_t>(position()), copy.begin(), copy.end());
                break;
            }
            case 5: {  // delete a range
                const size_t at = position(), length = std::min<size_t>(pick(64) + 1, input.size() - at);
                input.erase(input.begin() + static_cast<std::ptrdiff_t>(at), input.begin() + static_cast<std::ptrdiff_t>(at + length));
                break;
            }
            case 6: {  // splice: our head, the other seed's tail
                const size_t cut = position(), from = pick(other.size());
                input.resize(cut);
                input.insert(input.end(), other.begin() + static_cast<std::ptrdiff_t>(from), other.end());
                break;
            }
        }
    }
    return input;
}

}  // namespace

TEST_CASE("fuzz: every target refuses thousands of mutated inputs with an infer::Error, or accepts them, and never crashes") {
    constexpr int cases_per_target = 1000;
    std::mt19937_64 rng(20261203);
    int total = 0;
    for (const fuzz::Target& target : fuzz::targets) {
        const std::string name = target.name;
        std::vector<Bytes> seeds = fuzz::seeds_for(target.name);
        REQUIRE_MESSAGE(!seeds.empty(), name);
        for (const Bytes& seed : seeds) {  // the seeds themselves are valid inputs
            INFO("seed of " << name);
            CHECK_NOTHROW(target.run(seed));
        }
        int refused = 0;
        for (int i = 0; i < cases_per_target; ++i) {
            const Bytes& seed = seeds[static_cast<size_t>(i) % seeds.size()];
            Bytes input = mutate(seed, seeds[rng() % seeds.size()], rng);
            try {
                target.run(input);
            } catch (const infer::Error&) {
                ++refused;
            } catch (const std::exception& e) {
                FAIL_CHECK(name << " case " << i << ": a " << typeid(e).name() << " escaped: " << e.what());
            }
        }
        total += cases_per_target;
        MESSAGE(name << ": " << cases_per_target << " mutated inputs, " << refused << " refused with an infer::Error");
    }
    MESSAGE("deterministic fuzz run: " << total << " cases");
}
