/* next_b.c - test library: the next definition after next_a.c. */
const char *next_target(void) { return "b"; }
