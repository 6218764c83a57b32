"""mmspec_ray.toy"""
