/* The ELF note a real libnvidia-tls carries: NT_GNU_ABI_TAG, "GNU", Linux 2.3.99.
 * libnvidia-container chooses the TLS library by it and refuses a driver whose
 * libnvidia-tls lacks it; linked into the simulated libnvidia-tls only, as on
 * a real driver.  A section named .note.* is emitted as SHT_NOTE, and the
 * linker gives it a PT_NOTE program header. */
struct abi_note {
    unsigned int namesz, descsz, type;
    char name[4];
    unsigned int desc[4]; /* OS (0: Linux), then the earliest kernel version */
};

__attribute__((section(".note.ABI-tag"), aligned(4), used))
static const struct abi_note abi_tag = {4, 16, 1, "GNU", {0, 2, 3, 99}};
