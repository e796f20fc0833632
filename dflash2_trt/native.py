"""The native parts ``pip install`` builds into the package (cmake/wheel.cmake), by path: the ONNX Runtime op
library (:mod:`dflash2_trt.runtime.ort.decode_attention` loads it) and the C library libdflash2 with its header, its
CMake package and its pkg-config file. A part the build left out (no compiler, no ONNX Runtime headers) is absent;
an editable install of the source tree has none (scripts/setup.sh builds them under build/).

``python -m dflash2_trt.native`` prints what is installed; ``--cmake``, ``--pkgconfig``, ``--include`` or ``--lib``
print that one folder, for a C build::

    cmake -Ddflash2_DIR=$(python -m dflash2_trt.native --cmake) ...      # find_package(dflash2) -> dflash2::dflash2
    PKG_CONFIG_PATH=$(python -m dflash2_trt.native --pkgconfig) pkg-config --cflags --libs dflash2
"""

from __future__ import annotations

import argparse
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent
LIB_DIR = PACKAGE / "lib"  # libdflash2.so and libdflash2_ort_ops.so (libdflash2 finds the op library beside itself)
INCLUDE_DIR = PACKAGE / "include"  # dflash2/dflash2.h
CMAKE_DIR = LIB_DIR / "cmake" / "dflash2"  # dflash2Config.cmake
PKGCONFIG_DIR = LIB_DIR / "pkgconfig"  # dflash2.pc
C_LIBRARY = LIB_DIR / "libdflash2.so"
OPS_LIBRARY = LIB_DIR / "libdflash2_ort_ops.so"
FOLDERS = {"cmake": CMAKE_DIR, "pkgconfig": PKGCONFIG_DIR, "include": INCLUDE_DIR, "lib": LIB_DIR}


def installed() -> dict[str, Path | None]:
    """{"op library", "libdflash2", "header", "cmake", "pkgconfig"} -> the installed file, or None."""
    files = {"op library": OPS_LIBRARY, "libdflash2": C_LIBRARY, "header": INCLUDE_DIR / "dflash2" / "dflash2.h",
             "cmake": CMAKE_DIR / "dflash2Config.cmake", "pkgconfig": PKGCONFIG_DIR / "dflash2.pc"}
    return {k: p if p.is_file() else None for k, p in files.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dflash2_trt.native", description=__doc__.split("\n\n")[0])
    g = p.add_mutually_exclusive_group()
    for name in FOLDERS:
        g.add_argument(f"--{name}", action="store_true", help=f"print the {name} folder (exit 1 where it is absent)")
    a = p.parse_args(argv)
    chosen = [n for n in FOLDERS if getattr(a, n)]
    if chosen:
        folder = FOLDERS[chosen[0]]
        print(folder)
        return 0 if folder.is_dir() else 1
    for name, path in installed().items():
        print(f"{name:10s} {path or 'not installed'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
