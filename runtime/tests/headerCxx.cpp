// The public header compiles as C++17 (-Wall -Wextra -Wpedantic -Werror) and links.
#include "dflash2/dflash2.h"

#include <cstring>

int main()
{
    dfl2_callbacks cb{};
    cb.struct_size = sizeof(dfl2_callbacks);
    return cb.struct_size == sizeof(dfl2_callbacks) && dfl2_api_version() == DFL2_API_VERSION && std::strcmp(dfl2_status_message(nullptr), "ok") == 0 ? 0 : 1;
}
