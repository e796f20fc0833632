/* The public header compiles as strict C99 (-std=c99 -Wall -Wextra -Wpedantic -Werror) and links. */
#include "dflash2/dflash2.h"

#include <stdio.h>

int main(void)
{
    dfl2_callbacks cb = {0};
    dfl2_stats st = {0};
    dfl2_model_info info = {0};
    (void) cb;
    (void) st;
    (void) info;
    if ((dfl2_api_version() >> 16) != DFL2_API_VERSION_MAJOR) {
        fprintf(stderr, "library major %u != header major %d\n", dfl2_api_version() >> 16, DFL2_API_VERSION_MAJOR);
        return 1;
    }
    return dfl2_status_code(NULL) == DFL2_OK ? 0 : 1;
}
