"""Builds specserve's CPU kernels (specserve/csrc) into specserve/_C, a library of torch operators.

The operators are compiled against the PyTorch installed in the environment, so that PyTorch must
be there before this package is built, and pip must not build in an isolated environment (which
would fetch a PyTorch of its own: for a CPU machine, a multi-GB CUDA build):

    pip install torch==2.13.0            # or the build you want
    pip install --no-build-isolation -e .

Each instruction-set variant of the kernels (qgemm_<isa>.cpp for the GGUF products, cpu_kernels_<isa>.c
for the rest: attention, the layer's small operations, float32/int8/int4 products, the layer loop) is
compiled with its own flags (the AVX-512 variant: AVX2's flags plus AVX-512 F/BW/VL/DQ and VNNI);
the library runs the variants the CPU supports, and which of those runs a
projection is chosen by measurement (specserve.model.tuning). Never -march=native: the build must
run on any CPU of its architecture.
"""

from __future__ import annotations

import os
import platform
import sys

from setuptools import setup

try:
    import torch  # noqa: F401
    from torch.utils.cpp_extension import BuildExtension, CppExtension
except ImportError:
    sys.exit(
        "specserve: building the CPU kernels needs PyTorch in this environment. Install it first "
        "(`pip install torch==2.13.0`, or the build for your GPU), then install specserve without build "
        "isolation: `pip install --no-build-isolation -e .`"
    )

CSRC = os.path.join("specserve", "csrc")
COMMON = ["-O3", "-ffp-contract=off", "-fno-math-errno"]

HEADERS = ("gguf_blocks.h", "gguf_packed.h", "qgemm.h", "ops.h", "cpu_kernels.h", "cpu_kernels_table.h",
           "vec_exp.h", "gemm_small.c", "paged_attention.c", "layer_ops.c", "decoder.c")
CXX = ["-std=c++17"]
C = ["-std=gnu11", "-fopenmp"]  # the C kernels' loops are OpenMP regions (PyTorch's libgomp runs them)
AVX2 = ["-mavx2", "-mfma", "-mf16c"]
AVX512 = AVX2 + ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni"]

# Sources compiled apart from ops.cpp, each with its flags: the instruction-set variants (a variant's
# macro tells ops.cpp it was built) and the portable repacking.
X86 = platform.machine().lower() in ("x86_64", "amd64")
VARIANTS: list[tuple[str, list[str]]] = [(os.path.join(CSRC, "qgemm_generic.cpp"), CXX),
                                         (os.path.join(CSRC, "gguf_pack.cpp"), CXX),
                                         (os.path.join(CSRC, "cpu_kernels_generic.c"), C)]
if X86:
    VARIANTS += [(os.path.join(CSRC, "qgemm_avx2.cpp"), CXX + AVX2), (os.path.join(CSRC, "cpu_kernels_avx2.c"), C + AVX2),
                 (os.path.join(CSRC, "qgemm_avx512.cpp"), CXX + AVX512), (os.path.join(CSRC, "cpu_kernels_avx512.c"), C + AVX512 + ["-mprefer-vector-width=256"])]
DEFINES = [("SPECSERVE_HAVE_AVX2", "1"), ("SPECSERVE_HAVE_AVX512", "1")] if X86 else []


class Build(BuildExtension):
    """Compiles each variant with its own instruction-set flags, then links them into the library."""

    def build_extension(self, ext):  # type: ignore[no-untyped-def]
        if ext.name == "specserve._C":
            objects = []
            for source, flags in VARIANTS:
                objects += self.compiler.compile(
                    [source], output_dir=self.build_temp, include_dirs=[CSRC],
                    extra_postargs=["-fPIC", *COMMON, *flags],
                    depends=[os.path.join(CSRC, h) for h in HEADERS],
                )
            ext.extra_objects = objects
        super().build_extension(ext)


setup(
    ext_modules=[
        CppExtension(
            "specserve._C",
            [os.path.join(CSRC, "ops.cpp"), os.path.join(CSRC, "kernel_ops.cpp"), os.path.join(CSRC, "suffix_trie.cpp")],
            include_dirs=[CSRC],
            define_macros=DEFINES,
            # at::parallel_for is an OpenMP region compiled into this library (the runtime is PyTorch's libgomp)
            extra_compile_args={"cxx": [*COMMON, "-fopenmp"]},
            extra_link_args=["-fopenmp"],
            # the variants' sources too: a change to one alone must relink the library
            depends=[os.path.join(CSRC, h) for h in HEADERS] + [source for source, _ in VARIANTS],
        )
    ],
    cmdclass={"build_ext": Build.with_options(use_ninja=False)},
)
