/* next_a.c - test library: an RTLD_NEXT lookup made from here must find
 * next_b.c's next_target, even with the shim's dlsym in between. */
#define _GNU_SOURCE
#include <dlfcn.h>

const char *next_target(void) { return "a"; }

const char *next_probe(void)
{
    const char *(*f)(void);
    void *p = dlsym(RTLD_NEXT, "next_target");
    if (!p)
        return "none";
    *(void **)&f = p;
    return f();
}
