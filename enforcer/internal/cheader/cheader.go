//go:build cgo

// Package cheader exposes the sizes, offsets and constants of
// enforcer/shim/include/mgpu_region.h as the C compiler sees them, so that
// tests can check the Go mirrors (enforcer/region, enforcer/attach) against
// the one source of truth. Only tests import it.
package cheader

/*
#cgo CFLAGS: -std=c11 -I${SRCDIR}/../../shim/include
#include <stddef.h>
#include "mgpu_region.h"

typedef struct { const char *name; size_t value; } mgpu_entry;

#define OFF(t, f) { #t "." #f, offsetof(t, f) }
#define SIZE(t) { "sizeof(" #t ")", sizeof(t) }
#define CONST(c) { #c, (size_t)(c) }

static const mgpu_entry mgpu_entries[] = {
	SIZE(mgpu_slot_t),
	OFF(mgpu_slot_t, pid),
	OFF(mgpu_slot_t, reserved),
	OFF(mgpu_slot_t, start_time),
	OFF(mgpu_slot_t, proc_dev),
	OFF(mgpu_slot_t, proc_ino),

	SIZE(mgpu_proc_t),
	OFF(mgpu_proc_t, waiting),
	OFF(mgpu_proc_t, reserved32),
	OFF(mgpu_proc_t, mem_reserved),
	OFF(mgpu_proc_t, gpu_ns),
	OFF(mgpu_proc_t, queued_ns),
	OFF(mgpu_proc_t, launches),
	OFF(mgpu_proc_t, throttled_ns),
	OFF(mgpu_proc_t, idle_ns),
	OFF(mgpu_proc_t, mem_ahead),

	SIZE(mgpu_control_t),
	OFF(mgpu_control_t, magic),
	OFF(mgpu_control_t, version),
	OFF(mgpu_control_t, size),
	OFF(mgpu_control_t, max_procs),
	OFF(mgpu_control_t, device_index),
	OFF(mgpu_control_t, instance_id),
	OFF(mgpu_control_t, policy),
	OFF(mgpu_control_t, core),
	OFF(mgpu_control_t, memory_limit),
	OFF(mgpu_control_t, period_ns),
	OFF(mgpu_control_t, max_queued_ns),
	OFF(mgpu_control_t, reserved_hdr),
	OFF(mgpu_control_t, grant),
	OFF(mgpu_control_t, enforcer_epoch),
	OFF(mgpu_control_t, heartbeat_ns),
	OFF(mgpu_control_t, contended),
	OFF(mgpu_control_t, wake),
	OFF(mgpu_control_t, used),
	OFF(mgpu_control_t, reserved_ctl),
	OFF(mgpu_control_t, reserved_tail),
	OFF(mgpu_control_t, slots),

	SIZE(mgpu_attach_req_t),
	OFF(mgpu_attach_req_t, magic),
	OFF(mgpu_attach_req_t, version),
	OFF(mgpu_attach_req_t, flags),
	OFF(mgpu_attach_req_t, sock_fd),

	SIZE(mgpu_attach_resp_t),
	OFF(mgpu_attach_resp_t, magic),
	OFF(mgpu_attach_resp_t, version),
	OFF(mgpu_attach_resp_t, status),
	OFF(mgpu_attach_resp_t, slot),
	OFF(mgpu_attach_resp_t, control_size),
	OFF(mgpu_attach_resp_t, device_index),
	OFF(mgpu_attach_resp_t, instance_id),
	OFF(mgpu_attach_resp_t, proc_size),
	OFF(mgpu_attach_resp_t, message),
	OFF(mgpu_attach_resp_t, peers),

	CONST(MGPU_REGION_MAGIC),
	CONST(MGPU_REGION_VERSION),
	CONST(MGPU_REGION_MAX_PROCS),
	CONST(MGPU_CONTROL_FILE_SIZE),
	CONST(MGPU_PROC_FILE_SIZE),
	CONST(MGPU_POLICY_FIXED_SHARE),
	CONST(MGPU_POLICY_GUARANTEED_BURST_SHARE),
	CONST(MGPU_POLICY_NATIVE_BURST_SHARE),
	CONST(MGPU_ATTACH_MAGIC),
	CONST(MGPU_ATTACH_VERSION),
	CONST(MGPU_ATTACH_FDS),
	CONST(MGPU_ATTACH_FLAG_PEERS),
	CONST(MGPU_ATTACH_FLAG_WAKE),
	CONST(MGPU_GRANT_ALL),
	CONST(MGPU_GRANT_ONE),
	CONST(MGPU_WAKE_BUSY),
	CONST(MGPU_WAKE_IDLE),
	CONST(MGPU_ATTACH_OK),
	CONST(MGPU_ATTACH_NO_INSTANCE),
	CONST(MGPU_ATTACH_NO_SLOT),
	CONST(MGPU_ATTACH_BAD_REQUEST),
	CONST(MGPU_ATTACH_INTERNAL),
	CONST(MGPU_ATTACH_MESSAGE_LEN),
};

static size_t mgpu_entry_count(void) { return sizeof(mgpu_entries) / sizeof(mgpu_entries[0]); }
static const char *mgpu_entry_name(size_t i) { return mgpu_entries[i].name; }
static size_t mgpu_entry_value(size_t i) { return mgpu_entries[i].value; }
*/
import "C"

// Values maps "sizeof(T)", "T.field" (offsetof) and macro names to their
// values in C.
func Values() map[string]uint64 {
	n := int(C.mgpu_entry_count())
	m := make(map[string]uint64, n)
	for i := 0; i < n; i++ {
		m[C.GoString(C.mgpu_entry_name(C.size_t(i)))] = uint64(C.mgpu_entry_value(C.size_t(i)))
	}
	return m
}
