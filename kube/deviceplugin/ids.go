package deviceplugin

import (
	"cmp"
	"fmt"
	"strconv"
	"strings"
)

// IDsPerGPU is the number of device IDs of one GPU: one per percent of its
// time, so that a container asking for mgpu-core N gets N IDs.
const IDsPerGPU = 100

// idPrefix starts every device ID.
const idPrefix = "mgpu-"

// ID is one device ID, mgpu-<gpu>-<k> with k two digits (00..99).
type ID struct {
	GPU int // NVML index
	K   int // 0..99
}

// String returns the ID as the kubelet sees it, e.g. mgpu-1-07.
func (id ID) String() string { return fmt.Sprintf("%s%d-%02d", idPrefix, id.GPU, id.K) }

// compareIDs orders IDs by GPU, then k.
func compareIDs(a, b ID) int {
	if c := cmp.Compare(a.GPU, b.GPU); c != 0 {
		return c
	}
	return cmp.Compare(a.K, b.K)
}

// ParseID reads an ID written by ID.String; anything else is an error.
func ParseID(s string) (ID, error) {
	rest, ok := strings.CutPrefix(s, idPrefix)
	g, k, ok2 := strings.Cut(rest, "-")
	if ok && ok2 && len(k) == 2 {
		gpu, err1 := strconv.Atoi(g)
		kk, err2 := strconv.Atoi(k)
		id := ID{GPU: gpu, K: kk}
		if err1 == nil && err2 == nil && gpu >= 0 && kk >= 0 && kk < IDsPerGPU && id.String() == s {
			return id, nil
		}
	}
	return ID{}, fmt.Errorf("%q is not a %s device ID (want mgpu-<gpu>-<00..99>)", s, ResourceName)
}

// gpuIDs returns the IDs of GPU gpu, k ascending.
func gpuIDs(gpu int) []ID {
	ids := make([]ID, IDsPerGPU)
	for k := range ids {
		ids[k] = ID{GPU: gpu, K: k}
	}
	return ids
}

// MemID is one device ID of the memory plugin (ACKMemory): one GiB of one
// GPU, mgpu-<gpu>-gib-<k> with k from 0 to the GPU's GiB less one.
type MemID struct {
	GPU int // NVML index
	K   int // 0..GiB-1
}

// memInfix separates a MemID's GPU from its k.
const memInfix = "-gib-"

// String returns the ID as the kubelet sees it, e.g. mgpu-1-gib-7.
func (id MemID) String() string { return fmt.Sprintf("%s%d%s%d", idPrefix, id.GPU, memInfix, id.K) }

// ParseMemID reads an ID written by MemID.String; anything else is an
// error.
func ParseMemID(s string) (MemID, error) {
	rest, ok := strings.CutPrefix(s, idPrefix)
	g, k, ok2 := strings.Cut(rest, memInfix)
	if ok && ok2 {
		gpu, err1 := strconv.Atoi(g)
		kk, err2 := strconv.Atoi(k)
		id := MemID{GPU: gpu, K: kk}
		if err1 == nil && err2 == nil && gpu >= 0 && kk >= 0 && id.String() == s {
			return id, nil
		}
	}
	return MemID{}, fmt.Errorf("%q is not an %s device ID (want mgpu-<gpu>-gib-<k>)", s, ACKMemory.Core)
}

// memIDs returns the IDs of a GPU of gib GiB, k ascending.
func memIDs(gpu, gib int) []MemID {
	ids := make([]MemID, gib)
	for k := range ids {
		ids[k] = MemID{GPU: gpu, K: k}
	}
	return ids
}
