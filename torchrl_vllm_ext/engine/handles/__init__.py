"""A service used from other processes (TorchRL ships its policy into Ray actors): who may
do what (:mod:`.owner`), the owner's and a handle's links (:mod:`.links`), the directory
actor that mirrors the owner's pool (:mod:`.directory`), a handle's view of the pool
(:mod:`.pool`) and the owner's reserved master port (:mod:`.ports`)."""
