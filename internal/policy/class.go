package policy

import "fmt"

// Class is an instance's priority class on a device that runs
// online/offline co-location (online_offline_switch 1 or 2).
type Class uint32

const (
	// Online instances (the default) get what their device's policy
	// gives them, as if no offline instance existed.
	Online Class = 0
	// Offline instances run only on device time no online instance
	// wants, shared among them by their cores as weights.
	Offline Class = 1
)

var classNames = [...]string{"online", "offline"}

// String returns the class's name, "online" or "offline".
func (c Class) String() string {
	if int(c) < len(classNames) {
		return classNames[c]
	}
	return fmt.Sprintf("class(%d)", uint32(c))
}

// Valid reports whether c is online or offline.
func (c Class) Valid() bool { return int(c) < len(classNames) }

// ParseClass converts a class name into a Class.
func ParseClass(s string) (Class, error) {
	for i, n := range classNames {
		if s == n {
			return Class(i), nil
		}
	}
	return 0, fmt.Errorf("unknown priority class %q (want online or offline)", s)
}
