/* Stands in for a driver program that needs a GPU to do anything useful (nvidia-debugdump,
 * nvidia-persistenced, the MPS daemons): it proves it was mounted and can run, and says what it
 * is.  TOOL_NAME comes from the compiler command line, the version from sim_host.h. */
#include <stdio.h>
#include "sim_host.h"

int main(void)
{
    printf("%s: simulated NVIDIA driver program, driver version %s\n", TOOL_NAME, SIM_DRIVER_VERSION);
    return 0;
}
