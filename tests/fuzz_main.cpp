// One libFuzzer program per fuzz target (FUZZ_TARGET names it; meson.build builds them with -Dfuzz=true and clang).
// Coverage-guided: libFuzzer mutates the inputs that reached new code. An empty corpus folder given on the command line
// is first filled with the target's seeds (fuzz_seeds.hpp). Any exception but infer::Error aborts, as a crash does.
#include "fuzz_targets.hpp"

#include <fstream>

namespace {

const fuzz::Target& chosen_target() {
    for (const fuzz::Target& target : fuzz::targets)
        if (std::string_view(target.name) == FUZZ_TARGET) return target;
    throw infer::Error(std::string("unknown fuzz target ") + FUZZ_TARGET);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
    for (int i = 1; i < *argc; ++i) {
        std::filesystem::path folder = (*argv)[i];
        std::error_code error;
        if ((*argv)[i][0] == '-' || !std::filesystem::is_directory(folder, error) || !std::filesystem::is_empty(folder, error)) continue;
        int n = 0;
        for (const fuzz::Bytes& seed : fuzz::seeds_for(FUZZ_TARGET))
            std::ofstream(folder / ("seed-" + std::to_string(n++)), std::ios::binary)
                .write(reinterpret_cast<const char*>(seed.data()), static_cast<std::streamsize>(seed.size()));
    }
    return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    static const fuzz::Target& target = chosen_target();
    fuzz::run_one(target, std::span<const uint8_t>(data, size));
    return 0;
}
