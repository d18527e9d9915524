// Package hook implements mgpu-hook, the OCI hook that admits a container's
// GPU shares (createRuntime) and releases them (poststop): request resolution
// from annotations and environment, OCI state and bundle parsing, the
// container's identity from /proc, and the calls to each device's enforcer.
package hook

import (
	"fmt"
	"strings"

	"github.com/mgpu-dev/mgpu/internal/policy"
)

// Request keys (DESIGN.md "Requests (compatible keys)").
const (
	AnnotationPolicy = "vke.volcengine.com/mgpu-compute-policy"
	AnnotationMemory = "vke.volcengine.com/mgpu-memory"
	AnnotationCore   = "vke.volcengine.com/mgpu-core"
	// AnnotationClass is the priority class, online (default) or offline
	// (docs/arbiter.md "Online and offline instances").
	AnnotationClass = "vke.volcengine.com/mgpu-class"

	EnvPolicy = "MGPU_COMPUTE_POLICY"
	EnvMemory = "MGPU_MEMORY"
	EnvCore   = "MGPU_CORE"
	EnvClass  = "MGPU_CLASS"
)

// Limits of the values a request may carry.
const (
	MinCore = 1
	MaxCore = 100
	// MaxMemoryMiB bounds a memory request (16 TiB, like the node config's
	// sim.gpu memory_mib) so that MiB to bytes never overflows; the
	// enforcer refuses anything above what its device has free.
	MaxMemoryMiB uint64 = 1 << 24
)

// Request is what a container asks of each of its devices.
type Request struct {
	// Policy is the compute policy the container asks for; meaningful only
	// when PolicySet. An unset policy means "whatever the device runs".
	Policy    policy.Policy
	PolicySet bool
	// Core is the compute quota (fixed-share, guaranteed-burst-share) or
	// weight (native-burst-share), a percent of the device, 1..100.
	Core int
	// MemoryMiB is the device-memory quota in MiB, at least 1.
	MemoryMiB uint64
	// Class is the priority class; unset (ClassKey "") means online.
	Class policy.Class

	// Keys name where each value came from (an annotation or an env key),
	// for messages; empty when the value is unset.
	PolicyKey, CoreKey, MemoryKey, ClassKey string
}

// ValueError is an invalid request value: the key it was read from, the
// value as written, and what to set instead.
type ValueError struct {
	Key   string
	Value string
	Want  string
}

func (e *ValueError) Error() string {
	return fmt.Sprintf("%s is %q; set it to %s", e.Key, e.Value, e.Want)
}

// MissingError is a request without a compute or memory quota.
type MissingError struct {
	// Keys lists the unset quotas as "annotation (or ENV)" pairs.
	Keys []string
}

func (e *MissingError) Error() string {
	return fmt.Sprintf("the container asks for an mgpu device but sets no %s", strings.Join(e.Keys, " and no "))
}

// EnvError is an environment that names a key twice with different values.
type EnvError struct {
	Key           string
	First, Second string
}

func (e *EnvError) Error() string {
	return fmt.Sprintf("%s is set twice (%q and %q); set it once", e.Key, e.First, e.Second)
}

const (
	wantCore   = "a percent from 1 to 100"
	wantMemory = "a whole number of MiB from 1 to 16777216, without a unit (e.g. 4096)"
	wantPolicy = "fixed-share, guaranteed-burst-share or native-burst-share (or leave it unset for the device's policy)"
	wantClass  = "online or offline (or leave it unset for online)"
)

// ResolveRequest reads a container's request from its annotations and its
// process environment (process.env of config.json, "KEY=VALUE" entries).
// For each of policy, class, core and memory the annotation wins over the env key;
// only the value that wins is validated. A missing policy means the
// device's; a missing core or memory is an error (*MissingError): mgpu never
// guesses a quota. Invalid values are *ValueError, never clamped.
func ResolveRequest(annotations map[string]string, env []string) (Request, error) {
	var r Request
	pick := func(ann, envKey string) (key, val string, ok bool, err error) {
		if v, found := annotations[ann]; found {
			return ann, v, true, nil
		}
		v, found, err := LookupEnv(env, envKey)
		if err != nil || !found {
			return "", "", false, err
		}
		return envKey, v, true, nil
	}

	key, val, ok, err := pick(AnnotationPolicy, EnvPolicy)
	if err != nil {
		return Request{}, err
	}
	if ok {
		p, perr := policy.Parse(val)
		if perr != nil {
			return Request{}, &ValueError{Key: key, Value: val, Want: wantPolicy}
		}
		r.Policy, r.PolicySet, r.PolicyKey = p, true, key
	}

	key, val, ok, err = pick(AnnotationClass, EnvClass)
	if err != nil {
		return Request{}, err
	}
	if ok {
		c, cerr := policy.ParseClass(val)
		if cerr != nil {
			return Request{}, &ValueError{Key: key, Value: val, Want: wantClass}
		}
		r.Class, r.ClassKey = c, key
	}

	var missing []string
	key, val, ok, err = pick(AnnotationCore, EnvCore)
	if err != nil {
		return Request{}, err
	}
	if ok {
		n, valid := parseDecimal(val, MaxCore)
		if !valid || n < MinCore {
			return Request{}, &ValueError{Key: key, Value: val, Want: wantCore}
		}
		r.Core, r.CoreKey = int(n), key
	} else {
		missing = append(missing, fmt.Sprintf("compute quota: set %s (or %s) to %s", AnnotationCore, EnvCore, wantCore))
	}

	key, val, ok, err = pick(AnnotationMemory, EnvMemory)
	if err != nil {
		return Request{}, err
	}
	if ok {
		n, valid := parseDecimal(val, MaxMemoryMiB)
		if !valid || n < 1 {
			return Request{}, &ValueError{Key: key, Value: val, Want: wantMemory}
		}
		r.MemoryMiB, r.MemoryKey = n, key
	} else {
		missing = append(missing, fmt.Sprintf("memory quota: set %s (or %s) to %s", AnnotationMemory, EnvMemory, wantMemory))
	}
	if len(missing) > 0 {
		return Request{}, &MissingError{Keys: missing}
	}
	return r, nil
}

// parseDecimal accepts only ASCII digits (no sign, space, unit, fraction or
// base prefix) with a value of at most max.
func parseDecimal(s string, max uint64) (uint64, bool) {
	if s == "" || len(s) > 20 {
		return 0, false
	}
	var n uint64
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c < '0' || c > '9' {
			return 0, false
		}
		n = n*10 + uint64(c-'0')
		if n > max {
			return 0, false
		}
	}
	return n, true
}

// LookupEnv finds key in env ("KEY=VALUE" entries, as in process.env). A
// key given twice with the same value counts once; with different values it
// is an *EnvError, since engines and libcs disagree on which one a process
// sees.
func LookupEnv(env []string, key string) (string, bool, error) {
	var val string
	found := false
	for _, kv := range env {
		k, v, ok := strings.Cut(kv, "=")
		if !ok || k != key {
			continue
		}
		if found && v != val {
			return "", false, &EnvError{Key: key, First: val, Second: v}
		}
		val, found = v, true
	}
	return val, found, nil
}
