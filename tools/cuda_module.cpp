// The infer program's door to infer_cuda.cu: the CUDA forward pass lives in a module (libinfer_cuda.so) that is
// opened the first time --device cuda asks for it. Linking it instead would map the CUDA runtime and cuBLAS (hundreds
// of megabytes) into every run, `infer --help` included; opened here, a CPU run never touches them.
//
// The module exports a few functions with C names (see the end of infer_cuda.cu); this file defines the header's
// cuda::device_available and cuda::make_forward_pass, all the program uses, on top of them. Where the module is
// looked for: $INFER_CUDA_MODULE when set (and only there); otherwise beside the infer program (a build directory),
// then in the directory it is installed to (INFER_CUDA_MODULE_DIR, from meson.build).
#include "infer.hpp"

#include <dlfcn.h>
#include <unistd.h>

#include <climits>
#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <string>
#include <vector>

namespace infer::cuda {
namespace {

struct Module {
    bool (*device_available)(std::string* why) = nullptr;
    ForwardPass* (*make_forward_pass)(const Model* model, const CudaOptions* options, std::string* error) = nullptr;
};

std::vector<std::filesystem::path> module_candidates() {
    std::vector<std::filesystem::path> candidates;
    if (const char* named = std::getenv("INFER_CUDA_MODULE"); named && *named) return {named};  // the user's choice, alone
    char self[PATH_MAX];
    const ssize_t length = readlink("/proc/self/exe", self, sizeof self - 1);
    if (length > 0) candidates.push_back(std::filesystem::path(std::string(self, static_cast<size_t>(length))).parent_path() /
                                         "libinfer_cuda.so");
#ifdef INFER_CUDA_MODULE_DIR
    candidates.push_back(std::filesystem::path(INFER_CUDA_MODULE_DIR) / "libinfer_cuda.so");
#endif
    return candidates;
}

// The module once opened, or nullptr with `why` saying what was tried. Opened at most once per process.
const Module* open_module(std::string* why) {
    static std::once_flag once;
    static Module module;
    static std::string failure;
    static bool opened = false;
    std::call_once(once, [] {
        std::string tried;
        for (const std::filesystem::path& candidate : module_candidates()) {
            std::error_code error;
            if (!std::filesystem::is_regular_file(candidate, error)) {
                tried += "\n  " + candidate.string() + ": not found";
                continue;
            }
            void* handle = dlopen(candidate.c_str(), RTLD_NOW | RTLD_LOCAL);
            if (!handle) {
                const char* message = dlerror();
                tried += "\n  " + candidate.string() + ": " + (message ? message : "cannot be opened");
                continue;
            }
            // A module built from another version of infer.hpp would read this program's Model and Batch wrongly.
            auto layout = reinterpret_cast<unsigned long long (*)()>(dlsym(handle, "infer_cuda_module_layout"));
            module.device_available = reinterpret_cast<decltype(module.device_available)>(dlsym(handle, "infer_cuda_device_available"));
            module.make_forward_pass =
                reinterpret_cast<decltype(module.make_forward_pass)>(dlsym(handle, "infer_cuda_make_forward_pass"));
            if (!layout || !module.device_available || !module.make_forward_pass) {
                tried += "\n  " + candidate.string() + ": not an infer CUDA module (its entry points are missing)";
                dlclose(handle);
                continue;
            }
            if (layout() != module_layout()) {
                tried += "\n  " + candidate.string() + ": built from another version of infer.hpp than this program (" +
                         INFER_VERSION_STRING + "); rebuild both together";
                dlclose(handle);
                continue;
            }
            opened = true;  // kept open for the life of the process: the forward passes it makes run its code
            return;
        }
        failure = "the CUDA module libinfer_cuda.so could not be loaded:" + tried +
                  "\n(set INFER_CUDA_MODULE=PATH to name it; it is built beside infer when nvcc is found)";
    });
    if (!opened && why) *why = failure;
    return opened ? &module : nullptr;
}

}  // namespace

bool device_available(std::string* why) {
    const Module* module = open_module(why);
    return module && module->device_available(why);
}

std::unique_ptr<ForwardPass> make_forward_pass(const Model& model, CudaOptions options) {
    std::string why;
    const Module* module = open_module(&why);
    if (!module) fail("--device cuda: ", why);
    std::unique_ptr<ForwardPass> pass(module->make_forward_pass(&model, &options, &why));
    if (!pass) fail(why);
    return pass;
}

}  // namespace infer::cuda
